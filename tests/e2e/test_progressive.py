"""Progressive leases over the wire (docs/ARCHITECTURE.md, "Progressive pull"), against
real server processes: P's engine opens a lease at its first chunk and commits the rest;
D's claimant follows the commits with WaitCommit (held on P until the next commit, never
polled) and reports the lease consumed only over its final blocks; D's Transfer reads each
chunk while P computes the next, and every way a stream can end early leaves nothing held."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.errors import FailedPrecondition, InvalidArgument, KvsvcError, PermissionDenied
from kvsvc.leases.records import blocks_digest
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import layout_table, servers, session

pytestmark = pytest.mark.timeout(120)

LAYOUT = layout_table(k=2)  # blocks of 4 tokens, 32 of them a rank
TOKENS = 4  # a block's


def opening(request_id: str, blocks: list[int]) -> pb.PublishBlocksRequest:
    return pb.PublishBlocksRequest(request_id=request_id, block_ids_per_group=[pb.BlockIds(block_ids=blocks)],
                                   num_tokens=TOKENS * len(blocks), progressive=True)


def committing(params: pb.TransferParams, epoch: int, blocks: list[int], num_tokens: int,
               final: bool = False) -> pb.CommitBlocksRequest:
    return pb.CommitBlocksRequest(request_id=params.remote_request_id, lease_token=params.lease_token,
                                  commit_epoch=epoch, block_ids_per_group=[pb.BlockIds(block_ids=blocks)],
                                  num_tokens=num_tokens, final=final)


def claiming(params: pb.TransferParams, claim_id: str, consumed: bool = False, digest: bytes = b"") -> pb.ClaimLeaseRequest:
    return pb.ClaimLeaseRequest(request_id=params.remote_request_id, lease_epoch=params.remote_epoch,
                                engine_id="d-engine", tp_size=1, lease_token=params.lease_token, claim_id=claim_id,
                                consumed=consumed, blocks_digest=digest)


def waiting(params: pb.TransferParams, claim_id: str, after: int, wait_ms: int) -> pb.WaitCommitRequest:
    return pb.WaitCommitRequest(request_id=params.remote_request_id, lease_epoch=params.remote_epoch,
                                engine_id="d-engine", claim_id=claim_id, after_epoch=after, wait_ms=wait_ms)


def ids(resp: pb.WaitCommitResponse) -> list[list[int]]:
    return [list(g.block_ids) for g in resp.block_ids_per_group]


async def test_d_follows_the_commits_of_a_growing_lease_and_consumes_it_once_final():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            params = (await s.pc.publish_blocks_request(opening("grow", [1, 2]))).params
            assert params.progressive and [list(g.block_ids) for g in params.remote_block_ids_per_group] == [[1, 2]]
            claim_id = secrets.token_hex(16)
            await s.pc.claim_lease(claiming(params, claim_id))
            first = await s.pc.wait_commit(waiting(params, claim_id, 0, 0))
            assert (first.commit_epoch, first.final, ids(first)) == (1, False, [[1, 2]])
            # The next wait is held on P until the engine commits its next chunk.
            # (Reaching P before or after the commit, the wait answers the same.)
            held = asyncio.ensure_future(s.pc.wait_commit(waiting(params, claim_id, 1, 30_000), timeout_s=60))
            made = await s.pc.commit_blocks(committing(params, 2, [5, 6], 16))
            assert made.commit_epoch == 2
            got = await asyncio.wait_for(held, 30)
            assert (got.commit_epoch, got.final, ids(got), got.num_tokens) == (2, False, [[5, 6]], 16)
            assert (await s.pc.commit_blocks(committing(params, 2, [5, 6], 16))).commit_epoch == 2  # a retry
            with pytest.raises(FailedPrecondition) as e:  # reported consumed before the final commit
                await s.pc.claim_lease(claiming(params, claim_id, consumed=True))
            assert e.value.reason == "LEASE_NOT_FINAL"
            await s.pc.commit_blocks(committing(params, 3, [9], 20, final=True))
            last = await s.pc.wait_commit(waiting(params, claim_id, 2, 30_000))  # final: answered at once
            assert (last.commit_epoch, last.final, ids(last)) == (3, True, [[9]])
            every = [1, 2, 5, 6, 9]
            done = await s.pc.claim_lease(claiming(params, claim_id, consumed=True, digest=blocks_digest([every], 20)))
            assert done.state == pb.LEASE_STATE_CONSUMED
            (ev,) = await s.watch.wait_for("grow")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED and list(ev.block_ids_per_group[0].block_ids) == every
            assert (await s.pc.get_info()).live_leases == 0


async def test_commit_and_wait_refusals_are_typed_and_leave_the_lease_as_it_was():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            params = (await s.pc.publish_blocks_request(opening("refused", [1]))).params
            claim_id = secrets.token_hex(16)
            with pytest.raises(PermissionDenied) as e:  # a wait before a claim
                await s.pc.wait_commit(waiting(params, claim_id, 1, 0))
            assert e.value.reason == "LEASE_NOT_OWNER"
            await s.pc.claim_lease(claiming(params, claim_id))
            bad_token = committing(params, 2, [3], 8)
            bad_token.lease_token = "f" * 32
            with pytest.raises(PermissionDenied) as e:
                await s.pc.commit_blocks(bad_token)
            assert e.value.reason == "LEASE_TOKEN_MISMATCH"
            with pytest.raises(FailedPrecondition) as e:
                await s.pc.commit_blocks(committing(params, 3, [3], 8))
            assert e.value.reason == "COMMIT_OUT_OF_ORDER"
            with pytest.raises(InvalidArgument) as e:  # a block past P's pool
                await s.pc.commit_blocks(committing(params, 2, [10_000], 8))
            assert e.value.reason == "BLOCK_OUT_OF_RANGE"
            with pytest.raises(InvalidArgument) as e:
                await s.pc.wait_commit(waiting(params, claim_id, 1, 600_000))
            assert e.value.reason == "FIELD_TOO_LARGE"
            with pytest.raises(FailedPrecondition) as e:
                await s.pc.wait_commit(waiting(params, claim_id, 7, 0))
            assert e.value.reason == "COMMIT_OUT_OF_ORDER"
            for layers, reason in (([3], "INVALID_FIELD"), ([1, 1], "UNKNOWN_GROUP")):  # 2 layers, 1 group
                layered = committing(params, 2, [3], 8)
                layered.layers_done[:] = layers
                with pytest.raises(InvalidArgument) as e:
                    await s.pc.commit_blocks(layered)
                assert (e.value.reason, e.value.metadata["field"]) == (reason, "layers_done")
            layered = committing(params, 2, [3], 8, final=True)
            layered.layers_done[:] = [1]
            with pytest.raises(InvalidArgument) as e:  # a commit layer by layer is never final
                await s.pc.commit_blocks(layered)
            assert e.value.metadata["field"] == "layers_done"
            whole = (await s.pc.publish_blocks("whole", [[4]])).params
            with pytest.raises(FailedPrecondition) as e:
                await s.pc.commit_blocks(committing(whole, 2, [5], 8))
            assert e.value.reason == "LEASE_NOT_PROGRESSIVE"
            now = await s.pc.wait_commit(waiting(params, claim_id, 0, 0))
            assert (now.commit_epoch, ids(now)) == (1, [[1]])  # nothing of the refused commits stayed
            assert (await s.pc.get_info()).live_leases == 2
            await s.pc.notify(pb.NotifyRequest(request_id="refused", lease_epoch=params.remote_epoch,
                                               engine_id="d-engine", kind=pb.NOTIFY_KIND_ABORTED, claim_id=claim_id))


async def test_a_chunk_committed_layer_by_layer_is_shown_only_to_a_d_that_reads_layers():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            params = (await s.pc.publish_blocks_request(opening("layers", [1, 2]))).params
            claim_id = secrets.token_hex(16)
            await s.pc.claim_lease(claiming(params, claim_id))
            layered = committing(params, 2, [3, 4], 14)
            layered.layers_done[:] = [1]
            await s.pc.commit_blocks(layered)
            newer = waiting(params, claim_id, 1, 0)
            newer.reads_layers = True
            got = await s.pc.wait_commit(newer)
            assert (got.commit_epoch, ids(got), got.num_tokens) == (2, [[3, 4]], 14)
            assert (list(got.partial.blocks), list(got.partial.layers_done), got.partial.whole_num_tokens) == \
                ([2], [1], 8)
            older = await s.pc.wait_commit(waiting(params, claim_id, 1, 0))  # no reads_layers: an older D
            assert (older.commit_epoch, ids(older), older.num_tokens, older.HasField("partial")) == \
                (1, [[]], 8, False)
            await s.pc.commit_blocks(committing(params, 3, [], 14, final=True))
            older = await s.pc.wait_commit(waiting(params, claim_id, 1, 0))
            assert (older.commit_epoch, ids(older), older.num_tokens, older.final) == (3, [[3, 4]], 14, True)
            await s.pc.notify(pb.NotifyRequest(request_id="layers", lease_epoch=params.remote_epoch,
                                               engine_id="d-engine", kind=pb.NOTIFY_KIND_ABORTED, claim_id=claim_id))


async def test_a_release_mid_stream_ends_the_held_wait_and_later_commits():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            params = (await s.pc.publish_blocks_request(opening("gone", [1, 2]))).params
            claim_id = secrets.token_hex(16)
            await s.pc.claim_lease(claiming(params, claim_id))
            held = asyncio.ensure_future(s.pc.wait_commit(waiting(params, claim_id, 1, 30_000), timeout_s=60))
            await s.pc.notify(pb.NotifyRequest(request_id="gone", lease_epoch=params.remote_epoch,
                                               engine_id="d-engine", kind=pb.NOTIFY_KIND_ABORTED, claim_id=claim_id))
            with pytest.raises(FailedPrecondition) as e:
                await asyncio.wait_for(held, 30)
            assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "aborted"
            with pytest.raises(FailedPrecondition) as e:  # the engine's next chunk: the lease is gone
                await s.pc.commit_blocks(committing(params, 2, [3], 12))
            assert e.value.reason == "LEASE_EXPIRED"
            (ev,) = await s.watch.wait_for("gone")
            assert ev.reason == pb.RELEASE_REASON_ABORTED


async def claimed_on_p(s, request_id: str) -> None:
    """Until P's lease of request_id is claimed (D's transfer is following it)."""
    for _ in range(2000):
        leases = (await s.pc.list_leases(request_ids=[request_id])).leases
        if leases and leases[0].state == pb.LEASE_STATE_CLAIMED:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{request_id} was never claimed")


async def landed_on_d(s, d_ids: list[int], first_position: int = 0) -> None:
    """Until D's blocks d_ids hold P's request blocks from first_position on."""
    for _ in range(2000):
        if not s.de.check([d_ids], [first_position]):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"D's blocks {d_ids} never held P's: {s.de.check([d_ids], [first_position])}")


async def test_d_reads_each_chunk_while_p_still_prefills_and_consumes_the_lease_once_final():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            p_ids, d_ids = [1, 2, 5, 6, 9], [11, 12, 13, 14, 15]
            s.pe.fill([p_ids])  # P's request: what each block holds once computed
            params = (await s.pc.publish_blocks_request(opening("stream", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-stream", params, [d_ids], timeout_s=60))
            await claimed_on_p(s, "stream")
            await landed_on_d(s, d_ids[:2])  # the first chunk landed while P still computes the rest
            await s.pc.commit_blocks(committing(params, 2, [5, 6], 16))
            await landed_on_d(s, d_ids[:4])
            assert not moving.done()  # D waits for the tail: the lease is not final
            final_sent = time.perf_counter()
            await s.pc.commit_blocks(committing(params, 3, [9], 18, final=True))
            resp = await asyncio.wait_for(moving, 60)
            # What D reports as not hidden: from hearing of the final commit (after it was sent)
            # to its answer (before it came here) -- never the time it spent waiting for P.
            assert 0 < resp.after_final_us <= (time.perf_counter() - final_sent) * 1e6
            assert (resp.chunks_read_growing, resp.chunks_read_final) == (2, 1)
            assert not s.de.check([d_ids], num_tokens=18)
            per_block = sum(r.block_len for r in s.de.mem[0].regions)
            assert resp.total_bytes == per_block * len(d_ids)  # each block read once
            (ev,) = await s.watch.wait_for("stream")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED and list(ev.block_ids_per_group[0].block_ids) == p_ids
            assert (await s.pc.get_info()).live_leases == 0


async def test_a_prefix_d_holds_is_not_read_and_a_lease_final_before_d_comes_is_read_at_once():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            p_ids, d_tail = [1, 2, 3, 4], [20, 21]
            s.pe.fill([p_ids])
            params = (await s.pc.publish_blocks_request(opening("prefixed", [1, 2]))).params
            await s.pc.commit_blocks(committing(params, 2, [3, 4], 15, final=True))
            before = s.de.snapshot()
            resp = await s.dc.transfer("d-prefixed", params, [d_tail], local_prefix_tokens=8, timeout_s=60)
            assert 0 < resp.after_final_us <= resp.duration_us  # final before D came: nothing hidden
            assert not s.de.check([d_tail], [2], num_tokens=15)  # P's blocks 3 and 4, after D's 8 tokens
            s.de.restore_blocks(before, [d_tail])
            assert s.de.snapshot() == before  # nothing else on D was written
            (ev,) = await s.watch.wait_for("prefixed")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED


async def test_an_abort_on_p_mid_stream_fails_the_transfer_typed_and_leaves_nothing_held():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2, 3]])
            params = (await s.pc.publish_blocks_request(opening("dropped", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-dropped", params, [[11, 12, 13]], timeout_s=60))
            await claimed_on_p(s, "dropped")
            await landed_on_d(s, [11, 12])
            # P's engine aborts the request before its last chunk (it withdraws the lease).
            await s.pc.notify(pb.NotifyRequest(request_id="dropped", lease_epoch=params.remote_epoch,
                                               lease_token=params.lease_token, kind=pb.NOTIFY_KIND_ABORTED,
                                               withdraw=True))
            with pytest.raises(FailedPrecondition) as e:
                await asyncio.wait_for(moving, 60)
            assert e.value.reason == "LEASE_EXPIRED"
            failure = next(x for x in e.value.details if isinstance(x, pb.TransferFailure))
            assert list(failure.valid_local_block_ids_per_group) == []  # none of D's blocks counts as read
            with pytest.raises(FailedPrecondition) as e:  # the engine's next chunk: the lease is gone
                await s.pc.commit_blocks(committing(params, 2, [3], 12, final=True))
            assert e.value.reason == "LEASE_EXPIRED"
            assert (await s.pc.get_info()).live_leases == 0
            assert (await s.dc.list_leases()).running_transfers == 0


async def test_d_giving_up_mid_stream_gives_p_its_lease_back():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2]])
            params = (await s.pc.publish_blocks_request(opening("given-up", [1]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-given-up", params, [[11, 12]], timeout_s=60))
            await claimed_on_p(s, "given-up")
            await landed_on_d(s, [11])
            moving.cancel()  # D's caller goes away while D waits for the next commit
            with pytest.raises(asyncio.CancelledError):
                await moving
            (ev,) = await s.watch.wait_for("given-up")
            assert ev.reason == pb.RELEASE_REASON_ABORTED
            with pytest.raises(FailedPrecondition) as e:
                await s.pc.commit_blocks(committing(params, 2, [2], 8, final=True))
            assert e.value.reason == "LEASE_EXPIRED"
            assert (await s.pc.get_info()).live_leases == 0


async def test_a_lease_p_never_finishes_ends_at_d_deadline_and_blocks_that_cannot_pair_are_refused():
    with servers(1, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2, 3]])
            params = (await s.pc.publish_blocks_request(opening("stalled", [1]))).params
            with pytest.raises(KvsvcError) as e:
                await s.dc.transfer("d-stalled", params, [[11, 12]], timeout_s=3)
            assert e.value.reason == "DEADLINE_EXCEEDED"
            (ev,) = await s.watch.wait_for("stalled")
            assert ev.reason == pb.RELEASE_REASON_ABORTED
            # D named one block; P commits a second whole one: the lists cannot pair.
            params = (await s.pc.publish_blocks_request(opening("short", [1]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-short", params, [[11]], timeout_s=60))
            await claimed_on_p(s, "short")
            await s.pc.commit_blocks(committing(params, 2, [2], 8))
            with pytest.raises(InvalidArgument) as e:
                await asyncio.wait_for(moving, 60)
            assert e.value.reason == "BLOCK_COUNT_MISMATCH"
            (ev,) = await s.watch.wait_for("short")
            assert ev.reason == pb.RELEASE_REASON_ABORTED
            with pytest.raises(InvalidArgument) as e:  # the field is for progressive params only
                whole = (await s.pc.publish_blocks("whole", [[3]])).params
                await s.dc.transfer("d-whole", whole, [[11]], local_prefix_tokens=4)
            assert e.value.reason == "INVALID_FIELD" and e.value.metadata["field"] == "local_prefix_tokens"


async def test_the_stream_stalled_fault_keeps_the_first_chunk_and_drops_every_later_commit():
    """The fault the vLLM test of a P killed mid-stream relies on (service/faults.py): the
    engine's later commits are answered as made, D sees the lease stay at its first chunk, and
    a lease made whole is not touched."""
    p = start_server(engine_id="e2e-prefill", role="prefill", tp_size=1, layout=LAYOUT,
                     extra_env={"KVSVC_FAULTS": "stream_stalled"})
    d = start_server(engine_id="e2e-decode", role="decode", tp_size=1, layout=LAYOUT)
    try:
        async with session(p, d) as s:
            params = (await s.pc.publish_blocks_request(opening("stalled", [1]))).params
            claim_id = secrets.token_hex(16)
            await s.pc.claim_lease(claiming(params, claim_id))
            assert (await s.pc.commit_blocks(committing(params, 2, [2], 8))).commit_epoch == 2
            assert (await s.pc.commit_blocks(committing(params, 3, [3], 12))).commit_epoch == 3  # dropped
            assert (await s.pc.commit_blocks(committing(params, 4, [4], 14, final=True))).commit_epoch == 4
            now = await s.pc.wait_commit(waiting(params, claim_id, 1, 0))
            assert (now.commit_epoch, now.final, ids(now)) == (2, False, [[2]])
            assert (await s.pc.list_leases(request_ids=["stalled"])).leases[0].num_blocks == 2
            # D gives the stalled stream up: the lease ends now, not at P's shutdown drain
            await s.pc.notify(pb.NotifyRequest(request_id="stalled", kind=pb.NOTIFY_KIND_ABORTED, engine_id="d-engine",
                                               tp_size=1, lease_epoch=params.remote_epoch, claim_id=claim_id))
            assert not (await s.pc.list_leases(request_ids=["stalled"])).leases
            s.pe.fill([[5]])
            whole = await s.pc.publish_blocks("whole", [[5]])
            await s.dc.transfer("d-whole", whole.params, [[9]])
            assert not s.de.check([[9]])
    finally:
        d.stop()
        p.stop()


async def test_a_p_killed_mid_stream_fails_the_transfer_typed_and_d_holds_nothing():
    p = start_server(engine_id="e2e-prefill", role="prefill", tp_size=1, layout=LAYOUT)
    d = start_server(engine_id="e2e-decode", role="decode", tp_size=1, layout=LAYOUT)
    try:
        async with session(p, d) as s:
            s.pe.fill([[1, 2, 3]])
            params = (await s.pc.publish_blocks_request(opening("killed", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-killed", params, [[11, 12, 13]], timeout_s=60))
            await claimed_on_p(s, "killed")
            await landed_on_d(s, [11, 12])
            p.kill()  # P dies while D waits for its next commit
            with pytest.raises(KvsvcError) as e:
                await asyncio.wait_for(moving, 60)
            assert e.value.reason == "PEER_UNAVAILABLE", e.value
            failure = next(x for x in e.value.details if isinstance(x, pb.TransferFailure))
            assert list(failure.valid_local_block_ids_per_group) == [] and not failure.quarantined
            assert (await s.dc.list_leases()).running_transfers == 0
    finally:
        d.stop()
        p.stop()


@pytest.mark.parametrize(("p_tp", "d_tp", "d_block", "tokens"), [(2, 1, 4, 37), (1, 2, 4, 37), (1, 1, 8, 37),
                                                                  (2, 1, 16, 47)])
async def test_streams_pair_blocks_across_tp_sizes_and_block_sizes(p_tp, d_tp, d_block, tokens):
    """Chunks that end inside a D block (D's blocks of 8 or 16 tokens hold 2 or 4 of P's):
    a D block is read once all of it is committed, the last one partly filled."""
    p_ids = list(range(1, 1 + -(-tokens // TOKENS)))  # the last one partly filled
    d_ids = list(range(20, 20 + -(-tokens // d_block)))
    with servers(p_tp, d_tp, LAYOUT, layout_table(k=2, block=d_block)) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([p_ids])
            params = (await s.pc.publish_blocks_request(opening("tp", p_ids[:3]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-tp", params, [d_ids], timeout_s=60))
            await claimed_on_p(s, "tp")
            epoch, committed = 1, 3
            for upto in (5, 9):  # chunks of 2 and 4 blocks
                epoch += 1
                await s.pc.commit_blocks(committing(params, epoch, p_ids[committed:upto], TOKENS * upto))
                committed = upto
            await landed_on_d(s, d_ids[:TOKENS * committed // d_block])  # read before the final commit
            await s.pc.commit_blocks(committing(params, epoch + 1, p_ids[committed:], tokens, final=True))
            await asyncio.wait_for(moving, 60)
            assert not s.de.check([d_ids], num_tokens=tokens)
            (ev,) = await s.watch.wait_for("tp")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED


async def test_a_p_engine_over_two_servers_streams_each_servers_lease_and_d_reads_what_both_committed():
    """Each P server of the engine holds and grows its own lease of the request (a worker
    commits to its server); D follows both and reads a chunk once both committed it."""
    from kvsvc.cli.procs import start_engine
    from kvsvc.client import AsyncClient
    from tests.e2e.harness import Engine, ReleaseWatch

    token = secrets.token_hex(16)
    p_procs = start_engine(engine_id="e2e-prefill", role="prefill", tp_size=2, layout=LAYOUT, servers=2)
    d = start_server(engine_id="e2e-decode", role="decode", tp_size=2, layout=LAYOUT)
    try:
        async with contextlib.AsyncExitStack() as stack:
            pcs = [await stack.enter_async_context(AsyncClient(sp.address)) for sp in p_procs]
            dc = await stack.enter_async_context(AsyncClient(d.address))
            pes, de = [await Engine.of(c) for c in pcs], await Engine.of(dc)
            watches = [await ReleaseWatch.open(c) for c in pcs]
            p_ids, d_ids = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15]
            for pe in pes:
                pe.fill([p_ids])
            servers_ = []
            for c in pcs:
                info = await c.get_info()
                req = opening("two", [1, 2])
                req.lease_token = token  # the engine's token: each server leases its own ranks, no fan-out
                await c.publish_blocks_request(req)
                servers_.append(pb.EngineServer(address=c.address, ranks=list(info.hosted_ranks),
                                                epoch=info.epoch))
            params = pb.TransferParams(remote_address=servers_[0].address, remote_engine_id="e2e-prefill",
                                       remote_request_id="two", remote_epoch=servers_[0].epoch, remote_tp_size=2,
                                       lease_token=token, remote_servers=servers_, progressive=True,
                                       remote_block_ids_per_group=[pb.BlockIds(block_ids=[1, 2])])
            moving = asyncio.ensure_future(dc.transfer("d-two", params, [d_ids], timeout_s=60))
            # The servers commit apart, as two workers do: the second lags a chunk behind.
            await pcs[0].commit_blocks(committing(params, 2, [3, 4], 16))
            await pcs[0].commit_blocks(committing(params, 3, [5], 18, final=True))
            await pcs[1].commit_blocks(committing(params, 2, [3, 4], 16))
            assert not moving.done()
            await pcs[1].commit_blocks(committing(params, 3, [5], 18, final=True))
            await asyncio.wait_for(moving, 60)
            assert not de.check([d_ids], num_tokens=18)
            for w, c in zip(watches, pcs, strict=True):
                (ev,) = await w.wait_for("two")
                assert ev.reason == pb.RELEASE_REASON_CONSUMED
                assert (await c.get_info()).live_leases == 0
                await w.close()
            for e in (*pes, de):
                e.close()
    finally:
        d.stop()
        for sp in p_procs:
            sp.stop()



async def logged(sp, text: str, moving: asyncio.Future) -> None:
    """Until sp's output has a line with text (the transfer `moving` must not end first)."""
    while not any(text in line for line in list(sp.output)):
        if moving.done():
            raise AssertionError(f"the transfer ended before {text!r} was logged: {moving.result()}")
        await asyncio.sleep(0.02)


async def test_a_wait_p_leaves_unanswered_is_asked_again_and_the_stream_lands_its_bytes():
    """P does not answer D's wait for the next commit before the call's deadline (the
    wait_unanswered fault: a P whose event loop stalled for seconds -- seen on a busy 2-core
    host -- though its lease holds): D asks again, and once P commits, the stream lands P's
    bytes. A D that gave the stream up at the first unanswered wait failed requests of a P
    that was only slow (and vLLM recomputed them)."""
    p = start_server(engine_id="e2e-prefill", role="prefill", tp_size=1, layout=LAYOUT,
                     extra_env={"KVSVC_FAULTS": "wait_unanswered"})
    d = start_server(engine_id="e2e-decode", role="decode", tp_size=1, layout=LAYOUT, global_args=["-v"])
    try:
        async with session(p, d) as s:
            p_ids, d_ids = [1, 2, 5], [11, 12, 13]
            s.pe.fill([p_ids])
            params = (await s.pc.publish_blocks_request(opening("slow-p", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-slow-p", params, [d_ids], timeout_s=60))
            await logged(d, "did not answer a wait for commits of slow-p in time; asking again", moving)
            await s.pc.commit_blocks(committing(params, 2, [5], 10, final=True))
            resp = await asyncio.wait_for(moving, 60)
            assert (resp.chunks_read_growing, resp.chunks_read_final) == (1, 1)
            assert not s.de.check([d_ids], num_tokens=10)
            (ev,) = await s.watch.wait_for("slow-p")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED
    finally:
        d.stop()
        p.stop()
