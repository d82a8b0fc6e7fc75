"""A request that waits in D's queue longer than P's lease still loads: D's connector
heartbeats the P leases of the requests it holds and has not yet given blocks to.

The connector's own scheduler and rank-0 worker (no vLLM engine around them), a real P
server process whose leases live 1.5 s, real NIXL. D takes one step as the request
arrives, then none for three lease lifetimes (a long step, or an idle engine: the worker
heartbeats on its own timer), then vLLM gives the request blocks and it loads. Without
heartbeats (the control) the lease has expired by then and the load fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.config import Role
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata, Receive
from kvsvc.integrations.vllm.scheduler import KvsvcScheduler
from kvsvc.integrations.vllm.worker import KvsvcWorker
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout

TTL_S = 1.5
TABLE = {"model_id": "hb", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 32, "dtype": "bfloat16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}


def _buffers() -> list[torch.Tensor]:
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    return [torch.zeros((r.num_blocks, r.block_len), dtype=torch.uint8) for r in regions]


def _request(req_id: str, params: dict) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=4 * 16,
                           status=SimpleNamespace(name="FINISHED_ABORTED"))


def _load_outcome(worker: KvsvcWorker, req_id: str, timeout_s: float = 30.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        _, recving, failed = worker.transfer_results(set())
        if req_id in recving:
            return "failed" if req_id in failed else "loaded"
        time.sleep(0.005)
    return "never reported"


async def _lease_states(address: str) -> dict[str, str]:
    async with AsyncClient(address) as pc:
        from kvsvc.v1 import kv_transfer_pb2 as pb

        return {lease.request_id: pb.LeaseState.Name(lease.state) for lease in (await pc.list_leases()).leases}


def _wait_in_queue(heartbeat_s: float, tmp_path) -> tuple[dict[str, str], str, KvsvcScheduler]:
    """One request waits 3 lease lifetimes in D's queue, then loads: (P's leases after the
    wait, the load's outcome, D's scheduler)."""
    config = tmp_path / "p.toml"
    config.write_text(f"[server]\nlease_ttl_s = {TTL_S}\n")
    p = start_server(engine_id="hb-p", role="prefill", tp_size=1, layout=TABLE, config_file=str(config))
    worker = KvsvcWorker(engine_id="hb-d", role=Role.DECODE, tp_rank=0, tp_size=1, heartbeat_s=heartbeat_s)
    sched = KvsvcScheduler(engine_id="hb-d", tp_size=1, dcp_size=1, is_producer=False,
                           lease_heartbeat_s=heartbeat_s)
    try:
        worker.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), _buffers()))

        async def publish():
            async with AsyncClient(p.address) as pc:
                return await pc.publish_blocks("hb-1", [[1, 2, 3, 4]])

        pub = asyncio.run(publish())
        params = kvparams.to_vllm(pub.params, num_tokens=4 * 16, tp_size=1, dcp_size=1)
        req = _request("d-hb-1", params)
        sched.on_new_request(req)
        worker.start_load_kv(sched.build_connector_meta(None))  # the step it arrives in
        time.sleep(3 * TTL_S)  # no step while it waits
        leases = asyncio.run(_lease_states(p.address))
        blocks = SimpleNamespace(blocks=[[]], get_unhashed_block_ids_all_groups=lambda: [[9, 10, 11, 12]])
        sched.update_state_after_alloc(req, blocks, 4 * 16)
        meta = sched.build_connector_meta(None)
        assert isinstance(meta, KvsvcConnectorMetadata) and set(meta.receive) == {"d-hb-1"}
        # Given blocks, it is no longer heartbeated: its transfer holds the lease now.
        assert meta.stop_keep_alive == ({"d-hb-1"} if heartbeat_s else set())
        assert isinstance(meta.receive["d-hb-1"], Receive)
        worker.start_load_kv(meta)
        return leases, _load_outcome(worker, "d-hb-1"), sched
    finally:
        worker.shutdown()
        sched.shutdown()
        p.stop()


def test_a_request_waiting_longer_than_the_lease_still_loads(tmp_path):
    leases, outcome, _ = _wait_in_queue(0.3, tmp_path)
    assert leases.get("hb-1") == "LEASE_STATE_OFFERED", leases
    assert outcome == "loaded"


def test_without_heartbeats_the_lease_expires_in_the_queue(tmp_path):
    """The control: the same wait with heartbeats off fails the load (the test can fail)."""
    leases, outcome, _ = _wait_in_queue(0.0, tmp_path)
    assert "hb-1" not in leases
    assert outcome == "failed"


def test_a_finished_request_stops_being_heartbeated():
    sched = KvsvcScheduler(engine_id="d", tp_size=1, dcp_size=1, is_producer=False, lease_heartbeat_s=5)
    def params() -> dict:
        return {"do_remote_prefill": True, kvparams.KEY: {"remote_request_id": "r"}}

    req = _request("d-1", params())
    sched.on_new_request(req)
    assert set(sched.build_connector_meta(None).keep_alive) == {"d-1"}
    sched.request_finished(req, [[]])
    meta = sched.build_connector_meta(None)
    assert meta.stop_keep_alive == {"d-1"} and set(meta.abandon) == {"d-1"}  # and its lease is aborted at once
    # Arrived and gone within one step: the workers hear of neither.
    other = _request("d-2", params())
    sched.on_new_request(other)
    sched.request_finished(other, [[]])
    meta = sched.build_connector_meta(None)
    assert meta.keep_alive == {} and meta.stop_keep_alive == set() and set(meta.abandon) == {"d-2"}


@pytest.mark.parametrize("value", ["5", -1, True, 10_000])
def test_a_bad_heartbeat_setting_is_refused(value):
    from kvsvc.integrations.vllm.connector import _checked_extra

    with pytest.raises(ValueError, match="lease_heartbeat_s"):
        _checked_extra({"lease_heartbeat_s": value})


def test_an_abandoned_request_is_aborted_at_p_over_the_channel_d_already_holds(tmp_path, monkeypatch):
    """D reads one request from P, then a second one is abandoned before its transfer: P's
    lease of the second is aborted at once (not left to its TTL), over the channel D's
    embedded server already holds to that P -- no new connection is dialled for it."""
    import kvsvc.client.leases as leases_module

    dialled: list[str] = []
    real_client = leases_module.AsyncClient
    monkeypatch.setattr(leases_module, "AsyncClient", lambda address, *a, **k: (dialled.append(address),
                                                                               real_client(address, *a, **k))[1])
    p = start_server(engine_id="ab-p", role="prefill", tp_size=1, layout=TABLE)
    worker = KvsvcWorker(engine_id="ab-d", role=Role.DECODE, tp_rank=0, tp_size=1, heartbeat_s=0.0)
    sched = KvsvcScheduler(engine_id="ab-d", tp_size=1, dcp_size=1, is_producer=False, lease_heartbeat_s=0.0)
    try:
        worker.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), _buffers()))

        async def publish(rid: str):
            async with AsyncClient(p.address) as pc:
                return await pc.publish_blocks(rid, [[1, 2, 3, 4]])

        loaded = _request("d-ab-1", kvparams.to_vllm(asyncio.run(publish("ab-1")).params, num_tokens=4 * 16,
                                                     tp_size=1, dcp_size=1))
        sched.on_new_request(loaded)
        blocks = SimpleNamespace(blocks=[[]], get_unhashed_block_ids_all_groups=lambda: [[9, 10, 11, 12]])
        sched.update_state_after_alloc(loaded, blocks, 4 * 16)
        worker.start_load_kv(sched.build_connector_meta(None))
        assert _load_outcome(worker, "d-ab-1") == "loaded"

        gone = _request("d-ab-2", kvparams.to_vllm(asyncio.run(publish("ab-2")).params, num_tokens=4 * 16,
                                                   tp_size=1, dcp_size=1))
        sched.on_new_request(gone)
        sched.request_finished(gone, [[]])
        meta = sched.build_connector_meta(None)
        assert set(meta.abandon) == {"d-ab-2"}
        worker.start_load_kv(meta)
        end = time.monotonic() + 30
        while "ab-2" in (leases := asyncio.run(_lease_states(p.address))) and time.monotonic() < end:
            time.sleep(0.05)
        assert leases == {}, leases  # ab-1 consumed, ab-2 aborted: nothing held until a TTL
        assert dialled == [], dialled
    finally:
        worker.shutdown()
        sched.shutdown()
        p.stop()


def _lease(address: str, request_id: str) -> tuple[str, int] | None:
    """(state, expires_unix_ms) of one of P's leases, or None once P forgot it."""
    async def listing():
        async with AsyncClient(address) as pc:
            from kvsvc.v1 import kv_transfer_pb2 as pb

            return [(pb.LeaseState.Name(x.state), x.expires_unix_ms) for x in (await pc.list_leases()).leases
                    if x.request_id == request_id]

    found = asyncio.run(listing())
    return found[0] if found else None


def _until(check, what: str, timeout_s: float = 60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    pytest.fail(f"never: {what}")


def test_a_p_stalled_past_a_heartbeat_round_keeps_its_waiting_leases(tmp_path):
    """P stops answering (SIGSTOP) for longer than one heartbeat call's timeout (5 s), but not
    for its lease's TTL: D's worker asks again once P is back, the lease is extended past where
    it stood before the stall, and the request loads. A worker that gave up after one
    unanswered round left the lease to run out."""
    ttl_s, heartbeat_s = 20.0, 0.3
    config = tmp_path / "p.toml"
    config.write_text(f"[server]\nlease_ttl_s = {ttl_s}\n")
    p = start_server(engine_id="hb-p", role="prefill", tp_size=1, layout=TABLE, config_file=str(config))
    worker = KvsvcWorker(engine_id="hb-d", role=Role.DECODE, tp_rank=0, tp_size=1, heartbeat_s=heartbeat_s)
    sched = KvsvcScheduler(engine_id="hb-d", tp_size=1, dcp_size=1, is_producer=False, lease_heartbeat_s=heartbeat_s)
    try:
        worker.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), _buffers()))

        async def publish():
            async with AsyncClient(p.address) as pc:
                return await pc.publish_blocks("hb-s", [[1, 2, 3, 4]])

        pub = asyncio.run(publish())
        req = _request("d-hb-s", kvparams.to_vllm(pub.params, num_tokens=4 * 16, tp_size=1, dcp_size=1))
        sched.on_new_request(req)
        worker.start_load_kv(sched.build_connector_meta(None))  # it waits in D's queue, heartbeated
        first = _lease(p.address, "hb-s")
        assert first is not None and first[0] == "LEASE_STATE_OFFERED", first
        # A heartbeat landed: the lease moved on from its first expiry.
        _until(lambda: (x := _lease(p.address, "hb-s")) and x[1] > first[1], "a heartbeat extended the lease")
        before_stall = _lease(p.address, "hb-s")
        assert before_stall is not None
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            _until(lambda: worker.heartbeat_rounds_short > 0, "a heartbeat round went unanswered")
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        after = _until(lambda: (x := _lease(p.address, "hb-s")) and x[1] > before_stall[1] and x,
                       "the lease was heartbeated again after P came back")
        assert after[0] == "LEASE_STATE_OFFERED", after
        blocks = SimpleNamespace(blocks=[[]], get_unhashed_block_ids_all_groups=lambda: [[9, 10, 11, 12]])
        sched.update_state_after_alloc(req, blocks, 4 * 16)
        worker.start_load_kv(sched.build_connector_meta(None))
        assert _load_outcome(worker, "d-hb-s") == "loaded"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.proc.pid, signal.SIGCONT)
        worker.shutdown()
        sched.shutdown()
        p.stop()
