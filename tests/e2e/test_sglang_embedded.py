"""The kvsvc servers SGLang's backend embeds (kvsvc.integrations.sglang.embedded), without
SGLang: a P and a D server in this process over SGLang-shaped pools (numpy buffers given as
addresses, K of every layer then V, as KVArgs gives them), real NIXL, real gRPC between them.
What SGLang's sender and receiver rely on: the lease, the pull, the release P hears of, a
withdraw refused while D holds a claim, and a cancelled transfer that ends only once settled.
The whole backend runs against real SGLang servers in tests/sglang."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import numpy as np
import pytest

from kvsvc.client import Client
from kvsvc.config import Role
from kvsvc.errors import KvsvcError
from kvsvc.integrations.sglang.embedded import SGLangServer
from kvsvc.integrations.sglang.layout import SGLangPools, SGLangWindowPool, describe
from kvsvc.leases.table import LeaseState, NotifyKind
from kvsvc.v1 import kv_transfer_pb2 as pb

LAYERS, PAGES, HEADS, HEAD_DIM = 2, 16, 2, 8
TOKEN = "a" * 32


def pools(tp_rank_seed: int | None) -> tuple[SGLangPools, list[np.ndarray]]:
    """One worker's K and V buffers: random (P) or zero (D)."""
    rng = np.random.default_rng(tp_rank_seed)
    bufs = [rng.integers(0, 255, (PAGES, HEADS * HEAD_DIM * 2), dtype=np.uint8) if tp_rank_seed is not None
            else np.zeros((PAGES, HEADS * HEAD_DIM * 2), np.uint8) for _ in range(2 * LAYERS)]
    return SGLangPools([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [b.shape[1] for b in bufs], 1, False,
                       HEADS, 1, "tiny|kv=auto"), bufs


@pytest.fixture
def pair():
    released: list[tuple[str, LeaseState]] = []
    done = threading.Event()

    def on_release(rid: str, how: LeaseState) -> None:
        released.append((rid, how))
        done.set()

    p_pools, p_bufs = pools(1)
    d_pools, d_bufs = pools(None)
    p = SGLangServer(engine_id="sglang-prefill-test", role=Role.PREFILL, tp_rank=0, tp_size=1,
                       description=describe(p_pools), host="127.0.0.1", on_release=on_release)
    d = SGLangServer(engine_id="sglang-decode-test", role=Role.DECODE, tp_rank=0, tp_size=1,
                       description=describe(d_pools), host="127.0.0.1")
    p.start()
    d.start()
    try:
        yield p, d, p_bufs, d_bufs, released, done
    finally:
        d.stop()
        p.stop()


def test_p_leases_d_pulls_the_pages_and_p_hears_consumed(pair):
    p, d, p_bufs, d_bufs, released, done = pair
    params = p.lease("sglang-1", [[3, 4, 5]], TOKEN)
    assert [s.address for s in params.remote_servers] == [p.address]
    resp = d.transfer("sglang-1", params, [[9, 10, 11]], 30).result(30)
    assert resp.total_bytes == 3 * 2 * LAYERS * HEADS * HEAD_DIM * 2
    for pb_, db in zip(p_bufs, d_bufs, strict=True):
        assert np.array_equal(db[[9, 10, 11]], pb_[[3, 4, 5]])
        assert not db[:9].any() and not db[12:].any()  # nothing else written
    assert done.wait(10) and released == [("sglang-1", LeaseState.CONSUMED)]
    assert p.final_state("sglang-1") is LeaseState.CONSUMED


def test_a_hybrid_swa_models_window_pages_move_from_their_own_pool():
    """A hybrid-SWA model: full pages from the KV pool and the window's pages from the
    sliding-window pool (smaller, its page ids its own), in one lease and one transfer."""
    windows = []
    for seed in (5, None):
        rng = np.random.default_rng(seed)
        bufs = [rng.integers(0, 255, (6, HEADS * HEAD_DIM * 2), dtype=np.uint8) if seed is not None
                else np.zeros((6, HEADS * HEAD_DIM * 2), np.uint8) for _ in range(2 * LAYERS)]
        windows.append((SGLangWindowPool([b.ctypes.data for b in bufs], [b.nbytes for b in bufs],
                                         [b.shape[1] for b in bufs], 4), bufs))
    (p_pools, p_bufs), (d_pools, d_bufs) = pools(1), pools(None)
    p = SGLangServer(engine_id="sglang-prefill-swa", role=Role.PREFILL, tp_rank=0, tp_size=1, host="127.0.0.1",
                       description=describe(dataclasses.replace(p_pools, swa=windows[0][0])))
    d = SGLangServer(engine_id="sglang-decode-swa", role=Role.DECODE, tp_rank=0, tp_size=1, host="127.0.0.1",
                       description=describe(dataclasses.replace(d_pools, swa=windows[1][0])))
    p.start()
    d.start()
    try:
        params = p.lease("sglang-swa", [[3, 4, 5, 12], [5, 1]], TOKEN)
        resp = d.transfer("sglang-swa", params, [[9, 10, 11, 15], [2, 4]], 30).result(30)
        row = HEADS * HEAD_DIM * 2
        assert resp.total_bytes == (4 + 2) * 2 * LAYERS * row
        for pb_, db in zip(p_bufs, d_bufs, strict=True):
            assert np.array_equal(db[[9, 10, 11, 15]], pb_[[3, 4, 5, 12]])
        for pb_, db in zip(windows[0][1], windows[1][1], strict=True):
            assert np.array_equal(db[[2, 4]], pb_[[5, 1]])
            assert not db[[0, 1, 3, 5]].any()
        with pytest.raises(KvsvcError) as e:  # page 6 is past the window pool's 6 pages
            p.lease("sglang-swa-2", [[3], [6]], TOKEN)
        assert e.value.reason == "BLOCK_OUT_OF_RANGE"
    finally:
        d.stop()
        p.stop()


def test_a_withdrawn_lease_fails_ds_transfer_typed_and_nothing_writes_after(pair):
    p, d, _, d_bufs, released, _ = pair
    params = p.lease("sglang-2", [[1, 2]], TOKEN)
    assert p.withdraw("sglang-2", TOKEN) is True
    with pytest.raises(KvsvcError) as e:
        d.transfer("sglang-2", params, [[1, 2]], 30).result(30)
    assert e.value.reason.startswith("LEASE_")
    # D may have read before its claim was refused (kvsvc reads while it claims): the pages'
    # content is then void, and the failure says so; nothing may write into them after it.
    snapshot = [b.copy() for b in d_bufs]
    time.sleep(0.3)
    assert all(np.array_equal(a, b) for a, b in zip(snapshot, d_bufs, strict=True))
    assert released == []  # a withdraw is P's own doing: no release event for it
    assert p.withdraw("sglang-never-leased", TOKEN) is True  # nothing to read: gone


def test_a_claimed_lease_is_not_withdrawn_and_its_release_comes_later(pair):
    p, _, _, _, released, done = pair
    params = p.lease("sglang-3", [[1]], TOKEN)
    claim = uuid.uuid4().hex
    with Client(p.address) as c:
        c.claim_lease(pb.ClaimLeaseRequest(request_id="sglang-3", lease_epoch=params.remote_epoch,
                                           engine_id="other-d", tp_size=1, lease_token=TOKEN, claim_id=claim))
        assert p.withdraw("sglang-3", TOKEN) is False  # D reads: P must wait
        assert not done.is_set()
        c.notify(pb.NotifyRequest(request_id="sglang-3", kind=pb.NOTIFY_KIND_ABORTED, engine_id="other-d", tp_size=1,
                                  lease_epoch=params.remote_epoch, lease_token=TOKEN, claim_id=claim))
    assert done.wait(10) and released == [("sglang-3", LeaseState.ABORTED)]


def test_a_cancelled_transfer_ends_once_settled_and_gives_p_its_lease_back(pair):
    p, d, _, d_bufs, released, done = pair
    params = p.lease("sglang-4", [list(range(1, 9))], TOKEN)
    fut = d.transfer("sglang-4", params, [list(range(1, 9))], 30)
    d.cancel("sglang-4")  # at once: before its task ran, or while it runs
    deadline = time.monotonic() + 30
    while not fut.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    snapshot = [b.copy() for b in d_bufs]
    time.sleep(0.3)
    assert all(np.array_equal(a, b) for a, b in zip(snapshot, d_bufs, strict=True))  # settled: no late write
    if fut.cancelled():  # P hears the lease end (D gave it back), or takes it back itself
        if not done.wait(5):
            assert p.withdraw("sglang-4", TOKEN) is True
        else:
            assert released == [("sglang-4", LeaseState.ABORTED)]
    else:  # it finished before the cancel reached it
        assert fut.exception() is None and done.wait(10) and released == [("sglang-4", LeaseState.CONSUMED)]


def test_releases_missed_while_the_release_watch_was_behind_are_reported_once(pair):
    """The release watch falls behind (here: its subscription may hold nothing, as if the loop
    had stalled through 64 MiB of releases): the leases released in the gap are looked up and
    reported once each, and later releases come through the new subscription as before. A
    withdrawn lease is not announced, and not waited for."""
    p, _, _, _, released, _ = pair
    p.lease("taken-back", [[9]], TOKEN)
    assert p.withdraw("taken-back", TOKEN)
    for i in range(3):
        p.lease(f"gap-{i}", [[i + 1]], TOKEN, ttl_ms=300)

    async def choke() -> None:
        for sub in list(p.server.node.leases._watchers):
            sub._max = 1  # the next release overflows it

    p.loop.run(choke(), 10)
    deadline = time.monotonic() + 10
    while len(released) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    p.lease("after", [[7]], TOKEN, ttl_ms=300)
    while len(released) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a duplicate would come right behind
    assert sorted(released) == [("after", LeaseState.EXPIRED)] + [(f"gap-{i}", LeaseState.EXPIRED) for i in range(3)]
    assert p._leases is not None and p._leases._leased == set() and p._leases.gap_repairs == 1


def test_a_withdraw_on_a_stalled_loop_is_answered_only_once_it_ran(pair):
    """P's server loop stalls (held on an event here) while SGLang takes a lease back, and D's
    claim is already queued on it: no answer is "not yet", never "gone" (SGLang would free
    pages D is about to read) -- once the loop runs, the claim comes first and the withdraw
    answers False; the room ends with the claim's release."""
    p, _, _, _, released, done = pair
    params = p.lease("stalled", [[2]], TOKEN)
    held, holding = threading.Event(), threading.Event()

    async def stall() -> None:
        holding.set()
        held.wait(60)  # blocks the loop itself, as a long stall would

    async def claim() -> None:  # D's claim, queued on the loop before the withdraw
        node = p.server.node
        node.leases.claim("stalled", params.remote_epoch, token=TOKEN, claim_id="c" * 32, d_engine_id="other-d",
                          d_tp_size=1)

    p.loop.submit(stall())
    assert holding.wait(30)
    claimed = p.loop.submit(claim())
    answer = p.withdraw_later("stalled", TOKEN)
    assert not answer.done() and not claimed.done()
    held.set()
    claimed.result(30)
    assert answer.result(30) is False  # D holds a claim: the pages stay SGLang's to keep
    assert not done.is_set() and released == []

    async def give_up() -> None:  # D gives its claim up: the room ends with that release
        p.server.node.leases.notify("stalled", NotifyKind.ABORTED, [0], params.remote_epoch, claim_id="c" * 32)

    p.loop.submit(give_up()).result(30)
    assert done.wait(30) and released == [("stalled", LeaseState.ABORTED)]


def test_params_of_a_reused_room_never_read_the_next_request_as_good(pair):
    """Trust four, fix 7: SGLang's request id and lease token come from its bootstrap room,
    which a client may use again. The first request's lease is taken back; the room's next
    request is leased with the same id, token and pages, and new bytes. A transfer with the
    first request's params (a late one) is refused -- never answered OK with the second
    request's KV -- and the second request's own params still move its bytes."""
    p, d, p_bufs, d_bufs, released, done = pair
    first = p.lease("sglang-room", [[6]], TOKEN)
    assert p.withdraw("sglang-room", TOKEN) is True
    for b in p_bufs:  # the room's next request fills the same page
        b[6] = (b[6] + 1) % 251
    second = p.lease("sglang-room", [[6]], TOKEN)
    assert first.remote_servers[0].lease_serial != second.remote_servers[0].lease_serial
    with pytest.raises(KvsvcError) as e:
        d.transfer("d-first", first, [[12]], 30).result(30)
    assert e.value.reason == "LEASE_EXPIRED", e.value
    assert p.server.node.leases.get("sglang-room").state is LeaseState.OFFERED  # untouched by the stale claim
    d.transfer("d-second", second, [[13]], 30).result(30)
    for pb_, db in zip(p_bufs, d_bufs, strict=True):
        assert np.array_equal(db[13], pb_[6])
    assert done.wait(10) and released == [("sglang-room", LeaseState.CONSUMED)]
