"""Streamed requests (progressive pull) through the connector's scheduler and workers.

A router sends a request to P and D at once: P's scheduler orders a commit per chunk its
steps compute, P's worker opens the lease at the first and commits the rest after each
forward, and D's worker reads each chunk while P computes the next. A request whose blocks
vLLM frees first (preempted, aborted) has its lease revoked before the next forward, and D
fails typed. The connector's scheduler and workers without a vLLM engine around them, real
embedded servers, real NIXL; the real engines are in test_progressive.py.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from kvsvc.config import Role
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm import stream_params
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata, Receive
from kvsvc.integrations.vllm.scheduler import KvsvcScheduler
from kvsvc.integrations.vllm.worker import KvsvcWorker
from tests.vllm.test_publish_in_workers import _live_leases, _loaded, _until, _worker

BLOCK = 16  # TABLE's block size: one vLLM block is one kvsvc block here


def _step(new: dict[str, list[int]] | None = None, scheduled: dict[str, int] | None = None,
          added: dict[str, list[int]] | None = None, preempted: set[str] | None = None) -> SimpleNamespace:
    """What vLLM's scheduler passes build_connector_meta (one KV cache group)."""
    added = added or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in (new or {}).items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(added), resumed_req_ids=set(),
                                              new_block_ids=[(ids,) for ids in added.values()]),
        num_scheduled_tokens=dict(scheduled or {}), preempted_req_ids=set(preempted or ()))


def _request(req_id: str, tokens: int, order: stream_params.StreamOrder) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_computed_tokens=0, num_prompt_tokens=tokens, max_tokens=1,
                           kv_transfer_params=stream_params.prefill_stream_params(order),
                           status=SimpleNamespace(name="RUNNING"))


def _p_scheduler(p: KvsvcWorker, block_size: int = BLOCK) -> KvsvcScheduler:
    sched = KvsvcScheduler(engine_id="pw-p", tp_size=1, dcp_size=1, is_producer=True, stream_block_size=block_size)
    assert p.info is not None
    sched.set_servers({0: p.info})
    return sched


def _d_params(p: KvsvcWorker, order: stream_params.StreamOrder) -> dict:
    """D's params as the router builds them, from what an earlier answer of P said of P."""
    assert p.info is not None
    earlier = kvparams.pending_params(engine_id="pw-p", request_id="earlier", block_ids=[[1]],
                                      servers=[(p.info.address, p.info.epoch, 0)], token="0" * 32, num_tokens=16,
                                      tp_size=1, dcp_size=1)
    ident = stream_params.identity(earlier)
    assert ident is not None
    return stream_params.decode_stream_params(ident, order)


def _run_step(sched: KvsvcScheduler, p: KvsvcWorker, req: SimpleNamespace, out: SimpleNamespace) -> KvsvcConnectorMetadata:
    """One P step: the metadata reaches the worker (revokes before the forward, commits after)."""
    meta = sched.build_connector_meta(out)
    p.revoke(meta)
    p.start_load_kv(meta)
    req.num_computed_tokens += out.num_scheduled_tokens.get(req.request_id, 0)  # the forward ran
    p.commit_after_forward(meta, None)
    return meta


def _claimed(p: KvsvcWorker, lease_id: str) -> bool:
    """Whether D holds a claim on lease_id on P's server (looked at in process)."""
    server = p._server
    assert server is not None
    lease = server.node.leases.get(lease_id)
    return lease is not None and bool(lease.claims)


def _same(p: KvsvcWorker, d: KvsvcWorker, p_block: int, d_block: int) -> bool:
    return all(torch.equal(a[p_block], b[d_block]) for a, b in zip(p.buffers, d.buffers, strict=True))


def test_d_reads_each_chunk_while_p_still_prefills_and_p_frees_once_d_is_done():
    p, d = _worker(Role.PREFILL, "pw-p", fill=3), _worker(Role.DECODE, "pw-d")
    try:
        sched, order = _p_scheduler(p), stream_params.new_stream()
        req = _request("s1", 3 * BLOCK, order)
        sched.on_new_request(req)  # vLLM takes it in: its lease opens (empty) with the next step
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": Receive([[20, 21, 22]], _d_params(p, order), True)}))
        queued = _run_step(sched, p, req, _step())  # a step that does not schedule it (P is busy)
        assert queued.open["s1"].epoch == 1 and queued.open["s1"].block_ids == [[]] and not queued.commit
        assert _until(lambda: _claimed(p, order.lease_id)), "D claims the lease while the request waits on P"
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        first = _run_step(sched, p, req, _step({"s1": [5]}, {"s1": BLOCK}))
        assert first.commit["s1"].epoch == 2 and first.commit["s1"].block_ids == [[5]] and not first.open
        # D read the first chunk before P computed the second (held on the bytes landing).
        assert _until(lambda: _same(p, d, 5, 20)), "D did not read the first chunk while P prefilled"
        assert not _same(p, d, 6, 21)
        _run_step(sched, p, req, _step(scheduled={"s1": BLOCK}, added={"s1": [6]}))
        last = _run_step(sched, p, req, _step(scheduled={"s1": BLOCK}, added={"s1": [7]}))
        assert last.commit["s1"].final and last.commit["s1"].num_tokens == 3 * BLOCK
        assert _loaded(d, "d-s1") == "loaded"
        assert all(_same(p, d, a, b) for a, b in ((5, 20), (6, 21), (7, 22)))
        stats = d.take_stats()
        assert stats is not None and stats.data["chunks_growing"] >= 1
        # P's request finishes with its one token: vLLM keeps its blocks until D is done.
        req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        delay, params = sched.request_finished(req, [[5, 6, 7]])
        assert delay and params["kvsvc"]["progressive"] and params["remote_request_id"] == order.lease_id
        p.start_load_kv(sched.build_connector_meta(_step()))
        assert _until(lambda: p.transfer_results(set())[0]) == {"s1"}
        assert _live_leases(p) == {}
    finally:
        d.shutdown()
        p.shutdown()


def test_a_prompt_of_one_chunk_is_opened_and_made_final_at_once():
    p, d = _worker(Role.PREFILL, "pw-p", fill=4), _worker(Role.DECODE, "pw-d")
    try:
        sched, order = _p_scheduler(p), stream_params.new_stream()
        req = _request("s1", BLOCK + 3, order)
        sched.get_num_new_matched_tokens(req, 0)
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": Receive([[30, 31]], _d_params(p, order), True)}))
        meta = _run_step(sched, p, req, _step({"s1": [8, 9]}, {"s1": BLOCK + 3}))
        assert meta.open["s1"].epoch == 1 and meta.commit["s1"].epoch == 2 and meta.commit["s1"].final
        assert _loaded(d, "d-s1") == "loaded"
        assert _same(p, d, 8, 30) and _same(p, d, 9, 31)
    finally:
        d.shutdown()
        p.shutdown()


def _layer_buffers(w: KvsvcWorker) -> list[list[int]]:
    """Per layer of TABLE's group, the indices of its regions' buffers."""
    from kvsvc.layout import layout_from_dict
    from kvsvc.layout.regions import build_pool_layout
    from tests.vllm.test_publish_in_workers import TABLE

    layout = layout_from_dict(TABLE, tp_size=1)
    names = [n for n, _ in layout.groups[0].layers()]
    return [[r.index for r in build_pool_layout(layout).regions if r.layer_name == n] for n in names]


def test_the_chunk_completing_a_prompt_is_read_layer_by_layer_as_its_forward_saves_them():
    p, d = _worker(Role.PREFILL, "pw-p", fill=6), _worker(Role.DECODE, "pw-d")
    layers = _layer_buffers(p)
    p.stream_layers([["l0", "l1"]], 4)  # vLLM's names of the group's two layers, in order
    try:
        sched, order = _p_scheduler(p), stream_params.new_stream()
        req = _request("s1", 2 * BLOCK, order)
        sched.on_new_request(req)
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": Receive([[40, 41]], _d_params(p, order), True)}))
        _run_step(sched, p, req, _step({"s1": [5]}, {"s1": BLOCK}))
        assert _until(lambda: _same(p, d, 5, 40))
        # The last chunk (block 6), as its forward computes it: until a layer is computed its
        # bytes on P are others.
        computed = [b[6].clone() for b in p.buffers]
        for b in p.buffers:
            b[6] ^= 0x5A
        meta = sched.build_connector_meta(_step(scheduled={"s1": BLOCK}, added={"s1": [6]}))
        assert meta.commit["s1"].final
        p.revoke(meta)

        def layer(i: int, p_block: int, d_block: int) -> bool:
            return all(torch.equal(p.buffers[r][p_block], d.buffers[r][d_block]) for r in layers[i])

        for r in layers[0]:  # layer 0 computed and saved: D reads it while P computes layer 1
            p.buffers[r][6] = computed[r]
        p.layer_saved(meta, "l0", lambda: None)
        assert _until(lambda: layer(0, 6, 41)), "D did not read layer 0 of the last chunk during the forward"
        for r in layers[1]:
            p.buffers[r][6] = computed[r]
        p.layer_saved(meta, "l1", lambda: None)  # the last layer: made whole after the forward
        p.start_load_kv(meta)
        req.num_computed_tokens += BLOCK
        p.commit_after_forward(meta, None)
        assert _loaded(d, "d-s1") == "loaded"
        # Each layer read once (a layer read before it was computed would have stayed wrong).
        assert _same(p, d, 5, 40) and _same(p, d, 6, 41)
        stats = p.take_stats()
        assert stats is not None and stats.data["layer_commits"] == 1
    finally:
        d.shutdown()
        p.shutdown()


def test_d_holding_a_prefix_reads_only_the_tail():
    p, d = _worker(Role.PREFILL, "pw-p", fill=5), _worker(Role.DECODE, "pw-d")
    try:
        sched, order = _p_scheduler(p), stream_params.new_stream()
        req = _request("s1", 3 * BLOCK, order)
        sched.get_num_new_matched_tokens(req, 0)
        d_params = _d_params(p, order)
        # D's own scheduler: a prefix hit of one block leaves two to load, from token 16 on.
        d_sched = KvsvcScheduler(engine_id="pw-d", tp_size=1, dcp_size=1, is_producer=False)
        d_req = SimpleNamespace(request_id="d-s1", kv_transfer_params=d_params, num_prompt_tokens=3 * BLOCK)
        assert d_sched.get_num_new_matched_tokens(d_req, BLOCK) == (2 * BLOCK, True)
        blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[41, 42]], blocks=[[]])
        d_sched.update_state_after_alloc(d_req, blocks, 2 * BLOCK)
        d_meta = d_sched.build_connector_meta(_step())
        assert d_meta.receive["d-s1"].prefix_tokens == BLOCK
        held = [b[40].clone() for b in d.buffers]  # D's own block of the prefix
        d.start_load_kv(d_meta)
        _run_step(sched, p, req, _step({"s1": [5, 6]}, {"s1": 2 * BLOCK}))
        _run_step(sched, p, req, _step(scheduled={"s1": BLOCK}, added={"s1": [7]}))
        assert _loaded(d, "d-s1") == "loaded"
        assert _same(p, d, 6, 41) and _same(p, d, 7, 42)
        assert all(torch.equal(b[40], h) for b, h in zip(d.buffers, held, strict=True)), "D's prefix block was read into"
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("when", ["preempted", "aborted"])
def test_blocks_vllm_frees_mid_stream_are_revoked_before_the_next_forward(when):
    p, d = _worker(Role.PREFILL, "pw-p", fill=6), _worker(Role.DECODE, "pw-d")
    try:
        sched, order = _p_scheduler(p), stream_params.new_stream()
        req = _request("s1", 3 * BLOCK, order)
        sched.get_num_new_matched_tokens(req, 0)
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": Receive([[20, 21, 22]], _d_params(p, order), True)}))
        _run_step(sched, p, req, _step({"s1": [5]}, {"s1": BLOCK}))
        assert _until(lambda: _same(p, d, 5, 20))
        if when == "preempted":
            meta = sched.build_connector_meta(_step(preempted={"s1"}))
        else:
            req.status = SimpleNamespace(name="FINISHED_ABORTED")
            assert sched.request_finished(req, [[5]]) == (False, None)
            meta = sched.build_connector_meta(_step())
        assert meta.revoke == {"s1": (order.lease_id, order.token)}
        p.revoke(meta)  # returns once taken back: the forward may now overwrite block 5
        assert _live_leases(p) == {}
        assert _loaded(d, "d-s1") == "failed"
        if when == "preempted":  # recomputed later, not streamed: its blocks are freed at once
            req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
            assert sched.request_finished(req, [[9, 10, 11]]) == (False, None)
        p.start_load_kv(sched.build_connector_meta(_step()))
        assert p.transfer_results(set())[0] == set(), "vLLM freed these blocks itself"
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("why", ["aborted in P's queue", "engine cannot stream"])
def test_a_stream_that_never_opens_fails_a_waiting_d_at_once(why):
    """D claims before P leases (lease_pending): a lease P will never make is refused, so D
    fails now rather than after its wait for the lease (30 s)."""
    p, d = _worker(Role.PREFILL, "pw-p"), _worker(Role.DECODE, "pw-d")
    try:
        sched, order = _p_scheduler(p, block_size=BLOCK if why.startswith("aborted") else 0), stream_params.new_stream()
        req = _request("s1", 3 * BLOCK, order)
        sched.get_num_new_matched_tokens(req, 0)
        d.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": Receive([[20, 21, 22]], _d_params(p, order), True)}))
        if why.startswith("aborted"):
            req.status = SimpleNamespace(name="FINISHED_ABORTED")
            assert sched.request_finished(req, []) == (False, None)
        meta = sched.build_connector_meta(_step())
        assert set(meta.revoke) == {"s1"}
        p.start_load_kv(meta)  # where vLLM did not call handle_preemptions: revoked here
        assert _loaded(d, "d-s1", timeout_s=15) == "failed"
        if not why.startswith("aborted"):  # prefilled all the same, then freed at once: no lease holds it
            req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
            assert sched.request_finished(req, [[1, 2, 3]]) == (False, None)
    finally:
        d.shutdown()
        p.shutdown()


def test_commits_cover_each_prompt_once_in_order_whatever_the_chunking():
    """Random prompts, block sizes and chunkings, against a checker of this test's own: the
    commits' blocks, joined, are the prompt's blocks in order; epochs count up from 1; the
    last commit alone is final and covers the prompt; tokens never go back."""
    from kvsvc.integrations.vllm.metadata import ServerInfo

    rng = random.Random(5)
    for case in range(60):
        block, per_logical = rng.choice([(16, 1), (32, 2), (64, 4)])
        sched = KvsvcScheduler(engine_id="e", tp_size=1, dcp_size=1, is_producer=True, stream_block_size=block)
        sched.set_servers({0: ServerInfo("127.0.0.1:1", 1, 0, per_logical)})
        prompt = rng.randrange(1, 400)
        order = stream_params.new_stream()
        req = _request(f"r{case}", prompt, order)
        sched.get_num_new_matched_tokens(req, 0)
        req.num_computed_tokens = rng.choice([0, 0, block * rng.randrange(0, 1 + (prompt - 1) // block)])  # P's own prefix hit
        allocated: list[int] = []
        next_id = 100
        commits = []
        first = True
        while req.num_computed_tokens < prompt:
            chunk = min(prompt - req.num_computed_tokens, rng.randrange(1, 150))
            need = -(-(req.num_computed_tokens + chunk) // block)
            added = list(range(next_id, next_id + need - len(allocated)))
            next_id += len(added)
            allocated += added
            out = _step({req.request_id: list(allocated)}, {req.request_id: chunk}) if first else \
                _step(scheduled={req.request_id: chunk}, added={req.request_id: added})
            first = False
            meta = sched.build_connector_meta(out)
            commits.append(meta.commit[req.request_id])
            req.num_computed_tokens += chunk
        joined = [b for c in commits for b in c.block_ids[0]]
        want = [k for b in allocated[:-(-prompt // block)] for k in range(b * per_logical, (b + 1) * per_logical)]
        assert joined == want, case
        assert [c.epoch for c in commits] == list(range(2, len(commits) + 2))  # 1: the empty opening
        assert [c.final for c in commits] == [False] * (len(commits) - 1) + [True]
        assert commits[-1].num_tokens == prompt
        assert all(a.num_tokens <= b.num_tokens for a, b in itertools.pairwise(commits))
        assert all(c.lease_id == order.lease_id and c.lease_token == order.token for c in commits)
