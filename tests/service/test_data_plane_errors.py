"""Bad input to the lease and transfer RPCs: the right code and reason, and nothing leaked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvsvc.client import AsyncClient
from kvsvc.codec import layout_to_proto
from kvsvc.config import MemoryMode, Role, load_config
from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, Unavailable
from kvsvc.layout import simple_layout
from kvsvc.service.server import RunningServer, create_server
from kvsvc.v1 import kv_transfer_pb2 as pb


@pytest.fixture
async def dp_server() -> AsyncIterator[RunningServer]:
    """A TP-1 server with a real shared-memory pool and a real NIXL agent, in this process."""
    running, _ = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, engine_id="svc"))
    try:
        yield running
    finally:
        await running.stop(0)


@pytest.fixture
async def client(dp_server) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{dp_server.port}") as c:
        yield c


async def test_info_reports_pools_and_transport(client, dp_server):
    info = await client.get_info()
    assert info.transport.nixl_available and info.transport.backends == ["UCX"]
    (pool,) = info.pools
    assert pool.memory_kind == pb.MEMORY_KIND_DRAM and pool.shm_name
    assert pool.size_bytes == dp_server.node.side.pool.size_bytes
    assert len(pool.regions) == 4 and all(r.base_address for r in pool.regions)
    assert {"transfer", "leases", "handshake"} <= set(info.capabilities)


async def test_publish_errors_leak_nothing(client, dp_server):
    with pytest.raises(InvalidArgument) as e:
        await client.publish_blocks("r", [[1, 64]])
    assert e.value.reason == "BLOCK_OUT_OF_RANGE"
    with pytest.raises(InvalidArgument) as e:
        await client.publish_blocks("r", [[1], [2]])
    assert e.value.reason == "UNKNOWN_GROUP"
    assert dp_server.node.leases.live_count == 0
    await client.publish_blocks("r", [[1]])
    with pytest.raises(KvsvcError) as e:
        await client.publish_blocks("r", [[2]])
    assert e.value.reason == "LEASE_EXISTS" and e.value.code is ErrorCode.ALREADY_EXISTS
    assert dp_server.node.leases.live_count == 1


async def test_claim_and_notify_errors(client, dp_server):
    epoch = dp_server.node.epoch
    with pytest.raises(FailedPrecondition) as e:
        await client.claim_lease(pb.ClaimLeaseRequest(request_id="nope", lease_epoch=epoch, engine_id="D", tp_size=1,
                                                      claim_id="c" * 32))
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "unknown"
    with pytest.raises(InvalidArgument) as e:
        await client.notify(pb.NotifyRequest(request_id="x"))
    assert e.value.reason == "MISSING_FIELD" and e.value.metadata["field"] == "lease_epoch"
    with pytest.raises(InvalidArgument) as e:
        await client.notify(pb.NotifyRequest(request_id="x", lease_epoch=epoch))
    assert e.value.reason == "UNSPECIFIED_ENUM"
    with pytest.raises(InvalidArgument) as e:
        await client.claim_lease(pb.ClaimLeaseRequest(request_id="nope", lease_epoch=epoch))
    assert e.value.reason == "MISSING_FIELD"


async def test_transfer_input_errors(client, dp_server):
    with pytest.raises(InvalidArgument) as e:
        await client.transfer("d", pb.TransferParams(), [[1]])
    assert e.value.reason == "MISSING_FIELD" and e.value.field_violations[0].field == "params.remote_address"
    params = pb.TransferParams(remote_address="127.0.0.1:1", remote_request_id="r", remote_epoch=5,
                               remote_block_ids_per_group=[pb.BlockIds(block_ids=[1])])
    with pytest.raises(Unavailable) as e:
        await client.transfer("d", params, [[1]], timeout_s=20)
    assert e.value.reason == "PEER_UNAVAILABLE" and e.value.metadata["address"] == "127.0.0.1:1"


async def test_handshake_refusals(client, dp_server):
    good = pb.HandshakeRequest(engine_id="D", tp_size=2, layout=layout_to_proto(simple_layout(tp_size=2)))
    resp = await client.handshake(good)
    assert resp.epoch == dp_server.node.epoch and resp.ranks[0].agent_metadata
    wrong = pb.HandshakeRequest(engine_id="D", tp_size=2, layout=good.layout, expected_engine_id="other")
    with pytest.raises(FailedPrecondition) as e:
        await client.handshake(wrong)
    assert e.value.reason == "UNKNOWN_ENGINE" and e.value.metadata["engine_id"] == "svc"
    bad = pb.HandshakeRequest(engine_id="D", tp_size=1,
                              layout=layout_to_proto(simple_layout(tp_size=1, head_size=128, dtype="float16")))
    with pytest.raises(FailedPrecondition) as e:
        await client.handshake(bad)
    assert {"HEAD_SIZE_MISMATCH", "DTYPE_MISMATCH"} <= set(e.value.metadata["violations"].split(","))
    lying = pb.HandshakeRequest(engine_id="D", tp_size=4, layout=good.layout)  # heads per rank are for TP 2
    with pytest.raises(InvalidArgument) as e:
        await client.handshake(lying)
    assert e.value.reason == "INVALID_LAYOUT"
    assert any("num_kv_heads_per_rank" in v.field for v in e.value.field_violations)


async def test_wrong_role_and_no_data_plane():
    cfg = load_config(listen="127.0.0.1:0", tp_size=1, role=Role.DECODE, memory=MemoryMode.NONE)
    running, port = await create_server(cfg)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            with pytest.raises(FailedPrecondition) as e:
                await c.publish_blocks("r", [[1]])
            assert e.value.reason == "WRONG_ROLE"
            params = pb.TransferParams(remote_address="127.0.0.1:1", remote_request_id="r", remote_epoch=5)
            with pytest.raises(Unavailable) as e:
                await c.transfer("d", params, [[1]])
            assert e.value.reason == "DATA_PLANE_UNAVAILABLE"
            info = await c.get_info()
            assert not info.transport.nixl_available and "none" in info.transport.unavailable_reason
    finally:
        await running.stop(0)


async def test_mixed_family_handshake(client):
    layout = layout_to_proto(simple_layout(tp_size=1, mla=True, head_size=8))
    group = layout.groups[0]
    inner = pb.UniformTypeSpecs(layers=[
        pb.LayerSpec(layer_name="a", spec=group.spec),
        pb.LayerSpec(layer_name="b", spec=pb.KvCacheSpec(full_attention=pb.FullAttentionSpec(
            num_kv_heads_per_rank=8, head_size=8, dtype=pb.DTYPE_BFLOAT16)))])
    del layout.groups[:]
    layout.groups.add(name="mixed", spec=pb.KvCacheSpec(uniform_type=inner))
    with pytest.raises(FailedPrecondition) as e:
        await client.handshake(pb.HandshakeRequest(engine_id="D", tp_size=1, layout=layout))
    assert e.value.reason == "MIXED_FAMILY_GROUP"
    assert "mla" in e.value.metadata["families"] and "attention" in e.value.metadata["families"]


async def test_allowed_peers_gate_handshake_claim_and_notify():
    from kvsvc.errors import PermissionDenied

    cfg = load_config(listen="127.0.0.1:0", tp_size=1, engine_id="gated", allowed_peers=("good-d",))
    running, port = await create_server(cfg)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            layout = layout_to_proto(simple_layout(tp_size=1))
            assert (await c.handshake(pb.HandshakeRequest(engine_id="good-d", tp_size=1, layout=layout))).ranks
            for call in (
                c.handshake(pb.HandshakeRequest(engine_id="bad-d", tp_size=1, layout=layout)),
                c.claim_lease(pb.ClaimLeaseRequest(request_id="r", lease_epoch=running.node.epoch, engine_id="bad-d",
                                                   tp_size=1)),
                c.notify(pb.NotifyRequest(request_id="r", kind=pb.NOTIFY_KIND_ABORTED, engine_id="bad-d")),
            ):
                with pytest.raises(PermissionDenied) as e:
                    await call
                assert e.value.reason == "PEER_NOT_ALLOWED" and e.value.metadata == {"engine_id": "bad-d"}
    finally:
        await running.stop(0)


@pytest.mark.parametrize("which", ["nixl thread", "copy lane"])
async def test_health_is_not_serving_when_the_nixl_thread_dies(which):
    """The data plane dying under a running server (its NIXL thread, or one of the copy
    threads long READs are split over): health says NOT_SERVING, transfers say why."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running, port = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, engine_id="dies"))
    try:
        data = running.node.data
        assert data is not None and data.copy_threads == 2  # a "both" server reads: it has lanes
        thread = data._thread if which == "nixl thread" else data._lanes._threads[1]

        def crash() -> bool:
            raise RuntimeError("simulated NIXL crash")

        thread._poll = crash  # the next progress step raises out of the thread's loop
        thread.need_progress(+1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(100):
                status = (await stub.Check(health_pb2.HealthCheckRequest())).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        async with AsyncClient(f"127.0.0.1:{port}", ) as c:
            with pytest.raises(Unavailable) as e:
                await c.publish_blocks("r", [[1]])
            assert e.value.reason == "DATA_PLANE_UNAVAILABLE"
    finally:
        await running.stop(0)


def test_config_rejects_unknown_keys_and_places_vram_ranks(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text('[server]\nlease_ttl = 5\n')
    with pytest.raises(InvalidArgument) as e:
        load_config(bad)
    assert e.value.reason == "INVALID_CONFIG" and "server.lease_ttl" in e.value.message
    worse = tmp_path / "role.toml"
    worse.write_text('[server]\nrole = "prefil"\n')
    with pytest.raises(InvalidArgument):
        load_config(worse)
    four = load_config(tp_size=8, ranks=(4, 5, 6, 7))
    assert [four.device_of(r) for r in four.ranks] == [0, 1, 2, 3]  # one GPU per hosted rank
    pinned = load_config(tp_size=2, ranks=(0, 1), cuda_devices=(3, 1))
    assert [pinned.device_of(r) for r in pinned.ranks] == [3, 1]
    with pytest.raises(InvalidArgument):
        load_config(tp_size=2, ranks=(0, 1), cuda_devices=(3,))
