"""P's scheduler side makes no network call; its workers lease the blocks, in process.

vLLM calls request_finished on its engine thread, between steps: any wait there stalls every
request of the engine. The connector's scheduler only mints the lease token and the params
there (lease_pending); the next step's metadata tells each worker to lease the blocks on its
own embedded server. The connector's scheduler and workers without a vLLM engine around
them, real embedded servers, real NIXL.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch

from kvsvc.config import Role
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata, Receive, ServerInfo
from kvsvc.integrations.vllm.scheduler import KvsvcScheduler
from kvsvc.integrations.vllm.worker import KvsvcWorker
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout

TABLE = {"model_id": "pw", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 64, "dtype": "bfloat16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}


def _finished(req_id: str, tokens: int = 32) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_computed_tokens=tokens, num_prompt_tokens=tokens,
                           kv_transfer_params={"do_remote_decode": True},
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def _worker(role: Role, engine_id: str, fill: int = 0) -> KvsvcWorker:
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    buffers = [torch.full((r.num_blocks, r.block_len), fill, dtype=torch.uint8) for r in regions]
    for b in buffers:  # every block of P distinct: a wrong block read shows
        b[:, 0] = torch.arange(b.shape[0], dtype=torch.uint8)
    w = KvsvcWorker(engine_id=engine_id, role=role, tp_rank=0, tp_size=1)
    w.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), buffers))
    w.buffers = buffers  # type: ignore[attr-defined]
    return w


def _until(check, timeout_s: float = 30.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.01)
    return None


def test_request_finished_makes_no_network_call_even_for_many_requests_in_one_step():
    """The servers the scheduler knows are a socket that never answers: the old way (a
    PublishBlocks per server from request_finished) connects to it and waits; now nothing
    connects, every request is delayed with params, and the step's metadata carries the leases."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=2, dcp_size=1, is_producer=True, lease_ttl_ms=4000)
        sched.set_servers({0: ServerInfo(address, 11, 0), 1: ServerInfo(address, 12, 1)})
        answers = [sched.request_finished(_finished(f"r{i}"), [[1 + i % 60, 2 + i % 60]]) for i in range(256)]
        assert all(delay for delay, _ in answers)
        meta = sched.build_connector_meta(None)
        try:
            listener.accept()
            connected = True
        except BlockingIOError:
            connected = False
        assert not connected, "request_finished must not reach any server"
        assert len(meta.publish) == 256 and meta.delayed == set(meta.publish)
        order, params = meta.publish["r5"], answers[5][1]
        tp = kvparams.from_vllm(params)
        assert tp.lease_pending and tp.lease_token == order.lease_token and len(tp.lease_token) == 32
        assert [list(g.block_ids) for g in tp.remote_block_ids_per_group] == order.block_ids == [[6, 7]]
        assert [(s.address, list(s.ranks), s.epoch) for s in tp.remote_servers] == [(address, [0], 11),
                                                                                    (address, [1], 12)]
        assert order.num_tokens == tp.remote_num_tokens == 32 and order.lease_ttl_ms == 4000
        assert len({o.lease_token for o in meta.publish.values()}) == 256, "one secret per request"
    finally:
        listener.close()


def _handed_over(p: KvsvcWorker, d: KvsvcWorker, sched: KvsvcScheduler, req_id: str, p_block: int):
    """P finishes req_id; D starts loading it into block 9 before P's workers saw the step."""
    delay, params = sched.request_finished(_finished(req_id, 16), [[p_block]])
    assert delay and kvparams.from_vllm(params).lease_pending
    d.start_load_kv(KvsvcConnectorMetadata(receive={f"d-{req_id}": Receive([[9]], params, True)}))
    time.sleep(0.3)  # D has read and is asking for the lease
    return sched.build_connector_meta(None)


def _loaded(d: KvsvcWorker, req_id: str, timeout_s: float = 30.0):
    def check():
        _, recving, failed = d.transfer_results(set())
        return ("failed" if req_id in failed else "loaded") if req_id in recving else None
    return _until(check, timeout_s)


def test_d_first_then_p_leases_in_process_and_d_reads_the_right_block():
    p, d = _worker(Role.PREFILL, "pw-p", fill=7), _worker(Role.DECODE, "pw-d")
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
        assert p.info is not None
        sched.set_servers({0: p.info})
        meta = _handed_over(p, d, sched, "q1", 5)
        p.start_load_kv(meta)  # the next step: the worker leases block 5
        assert _loaded(d, "d-q1") == "loaded"
        assert all(torch.equal(pb_[5], db[9]) for pb_, db in zip(p.buffers, d.buffers, strict=True))
        assert _until(lambda: p.transfer_results(set())[0]) == {"q1"}, "consumed: vLLM may free P's blocks"
    finally:
        d.shutdown()
        p.shutdown()


def test_a_lease_the_worker_cannot_make_frees_the_blocks_and_fails_d_at_once():
    p, d = _worker(Role.PREFILL, "pw-p"), _worker(Role.DECODE, "pw-d")
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
        assert p.info is not None
        sched.set_servers({0: p.info})
        meta = _handed_over(p, d, sched, "q2", 5)
        meta.publish["q2"].block_ids = [[10_000]]  # a block the server does not have: refused
        p.start_load_kv(meta)
        assert _until(lambda: p.transfer_results(set())[0]) == {"q2"}, "refused: the blocks go back to vLLM"
        # D does not wait out its claim's timeout (10 s) for a pending lease: the refusal's tombstone ends it.
        assert _loaded(d, "d-q2", 5) == "failed"
        stats = p.take_stats()
        assert stats is not None and stats.data["lease_failed"] == 1
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize(("tp", "dcp", "groups", "num_tokens"), [
    (1, 1, [[7, 8, 9]], 96), (2, 1, [[1], [], [2, 3]], 1), (4, 4, [[0, 5]], 33), (2, 2, [[]], 0)])
def test_the_params_built_by_hand_are_protobufs_own_json(tp, dcp, groups, num_tokens):
    """request_finished builds the params' JSON itself (protobuf's converter was most of its
    time); checked against protobuf's own JSON of the same TransferParams."""
    from kvsvc.v1 import kv_transfer_pb2 as pb

    servers = [(f"10.0.0.{r}:70{r}", 1000 + r, r) for r in range(tp)]
    made = kvparams.pending_params(engine_id="e", request_id="r-1", block_ids=groups, servers=servers,
                                   token="ab" * 16, num_tokens=num_tokens, tp_size=tp, dcp_size=dcp)
    proto = pb.TransferParams(
        remote_address=servers[0][0], remote_engine_id="e", remote_request_id="r-1",
        remote_block_ids_per_group=[pb.BlockIds(block_ids=g) for g in groups], remote_epoch=servers[0][1],
        remote_tp_size=tp, lease_token="ab" * 16, remote_dcp_size=dcp, remote_num_tokens=num_tokens,
        remote_servers=[pb.EngineServer(address=a, ranks=[r], epoch=e) for a, e, r in servers], lease_pending=True)
    assert made == kvparams.to_vllm(proto, num_tokens=num_tokens, tp_size=tp, dcp_size=dcp)
    assert kvparams.from_vllm(made) == proto


# ---- the early lease: made in the step whose forward completes the prompt ---------------

def _step_output(new: dict[str, list[int]] | None = None, scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    """What vLLM's scheduler passes build_connector_meta: new requests with their blocks (one
    group), none cached, and the tokens scheduled per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in (new or {}).items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
        num_scheduled_tokens=dict(scheduled or {}))


def _arriving(req_id: str, tokens: int = 16) -> SimpleNamespace:
    """A P request as vLLM schedules it: one output token, nothing computed yet."""
    r = _finished(req_id, tokens)
    r.num_computed_tokens, r.max_tokens = 0, 1
    return r


def _live_leases(p: KvsvcWorker) -> dict[str, str]:
    """The live leases of P's embedded server and their tokens (looked at in process)."""
    server = p._server
    assert server is not None
    return {lease.request_id: lease.token for lease in server.node.leases.listing(100)}


def _scheduled_to_finish(sched: KvsvcScheduler, p: KvsvcWorker, req: SimpleNamespace, blocks: list[int]):
    """vLLM schedules req's whole prompt in one step: the step's metadata reaches the worker."""
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = sched.build_connector_meta(_step_output({req.request_id: blocks}, {req.request_id: req.num_prompt_tokens}))
    assert meta.publish[req.request_id].early
    p.start_load_kv(meta)
    req.num_computed_tokens = req.num_prompt_tokens  # the forward ran
    return meta.publish[req.request_id]


def test_the_lease_exists_before_request_finished_hands_out_its_params():
    p, d = _worker(Role.PREFILL, "pw-p", fill=3), _worker(Role.DECODE, "pw-d")
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
        sched.set_servers({0: p.info})
        req = _arriving("e1")
        order = _scheduled_to_finish(sched, p, req, [5])
        assert _until(lambda: _live_leases(p)) == {"e1": order.lease_token}, "leased before vLLM finished it"
        delay, params = sched.request_finished(req, [[5]])
        assert delay and kvparams.from_vllm(params).lease_token == order.lease_token
        meta = sched.build_connector_meta(_step_output())
        assert meta.publish == {} and meta.delayed_early == {"e1"} and meta.withdraw == {}
        p.start_load_kv(meta)
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-e1": Receive([[9]], params, True)}))
        assert _loaded(d, "d-e1") == "loaded"
        assert all(torch.equal(a[5], b[9]) for a, b in zip(p.buffers, d.buffers, strict=True))
        assert _until(lambda: p.transfer_results(set())[0]) == {"e1"}
    finally:
        d.shutdown()
        p.shutdown()


def test_an_early_lease_is_withdrawn_when_its_blocks_changed_or_the_request_was_not_kept():
    p = _worker(Role.PREFILL, "pw-p")
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
        sched.set_servers({0: p.info})
        moved, aborted = _arriving("m1"), _arriving("a1")
        early_m = _scheduled_to_finish(sched, p, moved, [5])
        _scheduled_to_finish(sched, p, aborted, [6])
        assert set(_until(lambda: len(_live_leases(p)) == 2 and _live_leases(p))) == {"m1", "a1"}
        delay, params = sched.request_finished(moved, [[7]])  # its blocks are not those leased
        assert delay and kvparams.from_vllm(params).lease_token != early_m.lease_token
        aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
        assert sched.request_finished(aborted, [[6]]) == (False, None)
        meta = sched.build_connector_meta(_step_output())
        assert set(meta.withdraw) == {"m1", "a1"} and set(meta.publish) == {"m1"} and meta.delayed == {"m1"}
        p.start_load_kv(meta)
        new_token = kvparams.from_vllm(params).lease_token
        assert _until(lambda: _live_leases(p) == {"m1": new_token}), _live_leases(p)
        # Withdrawn leases make no release: vLLM hears of neither (it freed a1's blocks itself).
        time.sleep(0.3)
        assert p.transfer_results(set())[0] == set()
    finally:
        p.shutdown()


def test_an_early_lease_that_could_not_be_made_gives_the_blocks_back_once_they_are_kept():
    p = _worker(Role.PREFILL, "pw-p")
    try:
        sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
        sched.set_servers({0: p.info})
        req = _arriving("f1")
        _scheduled_to_finish(sched, p, req, [10_000])  # no such block: the server refuses the lease
        time.sleep(0.3)
        assert p.transfer_results(set())[0] == set(), "not before vLLM keeps the blocks"
        delay, _ = sched.request_finished(req, [[10_000]])
        assert delay
        p.start_load_kv(sched.build_connector_meta(_step_output()))
        assert _until(lambda: p.transfer_results(set())[0]) == {"f1"}
    finally:
        p.shutdown()


def test_step_outputs_it_cannot_follow_never_reach_vllms_scheduler():
    """A step output whose block lists do not line up with what was seen (a group more) is
    logged; the request is leased the regular way once it finishes."""
    sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
    sched.set_servers({0: ServerInfo("127.0.0.1:1", 7, 0)})
    req = _arriving("odd", tokens=64)
    sched.get_num_new_matched_tokens(req, 0)
    sched.build_connector_meta(_step_output({"odd": [1]}, {"odd": 32}))  # half the prompt
    odd = _step_output(scheduled={"odd": 32})
    odd.scheduled_cached_reqs = SimpleNamespace(req_ids=["odd"], resumed_req_ids=set(), new_block_ids=[([2], [3])])
    assert sched.build_connector_meta(odd).publish == {}
    req.num_computed_tokens = 64
    delay, _ = sched.request_finished(req, [[1, 2]])
    meta = sched.build_connector_meta(_step_output())
    assert delay and set(meta.publish) == {"odd"} and not meta.publish["odd"].early and meta.withdraw == {}


def test_a_prompt_prefilled_in_chunks_is_leased_with_all_its_blocks_in_its_last_chunk():
    sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True)
    sched.set_servers({0: ServerInfo("127.0.0.1:1", 7, 0)})
    req = _arriving("chunked", tokens=64)
    sched.get_num_new_matched_tokens(req, 0)
    assert sched.build_connector_meta(_step_output({"chunked": [4]}, {"chunked": 32})).publish == {}
    req.num_computed_tokens = 32
    last = _step_output(scheduled={"chunked": 32})
    last.scheduled_cached_reqs = SimpleNamespace(req_ids=["chunked"], resumed_req_ids=set(), new_block_ids=[([9],)])
    order = sched.build_connector_meta(last).publish["chunked"]
    assert order.early and order.block_ids == [[4, 9]] and order.num_tokens == 64
    req.num_computed_tokens = 64
    delay, params = sched.request_finished(req, [[4, 9]])
    assert delay and kvparams.from_vllm(params).lease_token == order.lease_token
    meta = sched.build_connector_meta(_step_output())
    assert meta.publish == {} and meta.delayed_early == {"chunked"}
