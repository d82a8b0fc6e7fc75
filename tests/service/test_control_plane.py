"""The real server in-process on port 0: GetInfo, PlanTransfer, health, errors."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvsvc.codec import layout_to_proto
from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.layout import simple_layout
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc


def blocks(*groups):
    return [pb.BlockIds(block_ids=list(g)) for g in groups]


def inline(tp: int, **kw) -> pb.InlineRemote:
    return pb.InlineRemote(layout=layout_to_proto(simple_layout(tp_size=tp, **kw)), tp_size=tp)


async def test_get_info_reports_engine_and_layout(control_client, control_server):
    info = await control_client.get_info()
    assert info.engine_id == "kvsvc-engine"
    assert info.tp_size == 2 and list(info.hosted_ranks) == [0, 1]
    assert info.layout.groups[0].spec.full_attention.num_kv_heads_per_rank == 4
    assert info.layout_hash == control_server.node.layout_hash
    assert info.epoch != 0
    assert info.advertised_address.endswith(f":{control_server.port}")


async def test_plan_transfer_inline_remote(control_client):
    req = pb.PlanTransferRequest(inline_remote=inline(1), local_block_ids_per_group=blocks([1, 2, 3]),
                                 remote_block_ids_per_group=blocks([7, 8, 9]))
    plan = await control_client.plan_transfer(req)
    assert [p.local_rank for p in plan.rank_plans] == [0, 1]
    r0, r1 = plan.rank_plans
    assert r0.tp_ratio == 2 and list(r0.handshake_target_ranks) == [0]
    assert r1.rank_offset_factor == 1
    # D rank 1 reads the second half of each P K block: 8 heads of 64 bf16 over 16 tokens.
    p_block = 16 * 8 * 64 * 2
    first = r1.reads[0].ranges[0]
    assert (first.remote_offset_bytes, first.length_bytes) == (7 * p_block + p_block // 2, p_block // 2)
    assert plan.total_bytes == 2 * 3 * 4 * (p_block // 2)


async def test_plan_summary_and_rank_selection(control_client):
    req = pb.PlanTransferRequest(inline_remote=inline(4), local_block_ids_per_group=blocks([1]),
                                 remote_block_ids_per_group=blocks([2]), local_ranks=[1], summary_only=True)
    plan = await control_client.plan_transfer(req)
    (only,) = plan.rank_plans
    assert only.local_rank == 1 and list(only.source_ranks) == [2, 3]
    assert all(not r.ranges for r in only.reads) and only.num_descriptors > 0


async def test_plan_prefix_hit(control_client):
    req = pb.PlanTransferRequest(inline_remote=inline(2), local_block_ids_per_group=blocks([5]),
                                 remote_block_ids_per_group=blocks([1, 2, 3]))
    plan = await control_client.plan_transfer(req)
    assert list(plan.prefix_blocks_skipped_per_group) == [2]
    assert plan.rank_plans[0].reads[0].ranges[0].remote_offset_bytes == 3 * 16 * 4 * 64 * 2


async def expect(client, req, exc_type, reason):
    with pytest.raises(exc_type) as e:
        await client.plan_transfer(req)
    assert e.value.reason == reason, e.value
    return e.value


async def test_error_bad_block_ids(control_client):
    err = await expect(control_client, pb.PlanTransferRequest(
        inline_remote=inline(1), local_block_ids_per_group=blocks([64]), remote_block_ids_per_group=blocks([0])),
        InvalidArgument, "BLOCK_OUT_OF_RANGE")
    assert err.metadata["block_id"] == "64" and err.metadata["num_blocks"] == "64"


async def test_error_non_divisible_tp(control_client):
    err = await expect(control_client, pb.PlanTransferRequest(
        inline_remote=inline(3, kv_heads=6), local_block_ids_per_group=blocks([1]),
        remote_block_ids_per_group=blocks([1])), FailedPrecondition, "TP_NOT_DIVISIBLE")
    assert err.metadata == {"local_tp_size": "2", "remote_tp_size": "3"}


async def test_error_unknown_group(control_client):
    err = await expect(control_client, pb.PlanTransferRequest(
        inline_remote=inline(1), local_block_ids_per_group=blocks([1], [2]),
        remote_block_ids_per_group=blocks([1], [2])), InvalidArgument, "UNKNOWN_GROUP")
    assert err.metadata["layout_groups"] == "1"


async def test_error_unspecified_enum(control_client):
    remote = inline(1)
    remote.layout.region_layout = pb.REGION_LAYOUT_UNSPECIFIED
    err = await expect(control_client, pb.PlanTransferRequest(
        inline_remote=remote, local_block_ids_per_group=blocks([1]), remote_block_ids_per_group=blocks([1])),
        InvalidArgument, "UNSPECIFIED_ENUM")
    assert err.field_violations[0].field == "inline_remote.layout.region_layout"


async def test_error_incompatible_layout(control_client):
    err = await expect(control_client, pb.PlanTransferRequest(
        inline_remote=inline(1, head_size=128, model_id="other"), local_block_ids_per_group=blocks([1]),
        remote_block_ids_per_group=blocks([1])), FailedPrecondition, "MODEL_MISMATCH")
    assert "HEAD_SIZE_MISMATCH" in err.metadata["violations"]


async def test_error_rank_not_hosted_and_missing_remote(control_client):
    await expect(control_client, pb.PlanTransferRequest(inline_remote=inline(1), local_ranks=[5]),
                 InvalidArgument, "RANK_NOT_HOSTED")
    await expect(control_client, pb.PlanTransferRequest(), InvalidArgument, "MISSING_FIELD")


async def test_rich_status_on_the_wire(control_server):
    """Read the raw google.rpc.Status with grpc's own helpers, not the kvsvc client."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_server.port}") as ch:
        stub = pb_grpc.KvTransferServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PlanTransfer(pb.PlanTransferRequest(
                inline_remote=inline(1), local_block_ids_per_group=blocks([99]),
                remote_block_ids_per_group=blocks([0])))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(e.value)
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info)
        assert (info.domain, info.reason) == ("kvsvc", "BLOCK_OUT_OF_RANGE")
        # The server keeps serving after bad input.
        assert (await stub.GetInfo(pb.GetInfoRequest())).tp_size == 2


async def test_health_serving_then_not_serving(control_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvsvc.v1.KvTransferService"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await control_server.health.enter_graceful_shutdown()
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_second_server_on_a_port_is_refused(control_server):
    from kvsvc.config import MemoryMode, load_config
    from kvsvc.service.server import create_server

    with pytest.raises(FailedPrecondition) as e:
        await create_server(load_config(listen=f"127.0.0.1:{control_server.port}", memory=MemoryMode.NONE))
    assert e.value.reason == "ADDRESS_IN_USE"


async def test_plan_by_address_needs_no_data_plane(control_server, control_client):
    # A control-plane-only server plans against another server named by address (here: itself, TP 2).
    req = pb.PlanTransferRequest(remote_address=f"127.0.0.1:{control_server.port}",
                                 local_block_ids_per_group=blocks([1, 2]), remote_block_ids_per_group=blocks([3, 4]),
                                 summary_only=True)
    plan = await control_client.plan_transfer(req)
    assert [p.tp_ratio for p in plan.rank_plans] == [1, 1]
    assert [list(p.source_ranks) for p in plan.rank_plans] == [[0], [1]]
