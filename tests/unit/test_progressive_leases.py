"""Progressive leases in the lease table (docs/ARCHITECTURE.md, "Progressive pull"): the
commit rule, the wait for the next commit (on an event, woken by the commit or the
release), what a stale or early epoch gets, and the promises of a plain lease kept
mid-stream (one owner, consumed only once final, blocks freed only when no lease holds
them, every waiter told how its lease ended)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvsvc.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvsvc.leases.records import blocks_digest
from kvsvc.leases.table import LeaseState, LeaseTable, NotifyKind

CLAIM = "c" * 32
OTHER = "o" * 32


@pytest.fixture
async def table():
    t = LeaseTable(epoch=3, hosted_ranks=[0], tp_size=1, default_ttl_s=5.0, max_ttl_s=60.0)
    t.start()
    yield t
    await t.close()


def opened(table: LeaseTable, rid: str = "r", first: list[list[int]] | None = None):
    lease = table.publish(rid, first if first is not None else [[1, 2], [7]], None, num_tokens=32, progressive=True)
    table.claim(rid, 3, token=lease.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=1)
    return lease


def commit(table, lease, epoch, blocks, final=False, num_tokens=64, layers=()):
    return table.commit(lease.request_id, 3, token=lease.token, commit_epoch=epoch, block_ids=blocks,
                        num_tokens=num_tokens, final=final, layers=layers)


def ids(lease) -> list[list[int]]:
    return [a.tolist() for a in lease.block_ids]


async def wait(table, rid="r", after=1, timeout_s=5.0, claim_id=CLAIM, layers=True):
    """(the lease, per group the blocks committed since after) as D sees them"""
    got, _, since = await seen(table, rid, after, timeout_s, claim_id, layers)
    return got, since


async def seen(table, rid="r", after=1, timeout_s=5.0, claim_id=CLAIM, layers=True):
    return await table.wait_commit(rid, 3, claim_id=claim_id, d_engine_id="D", after_epoch=after,
                                   timeout_s=timeout_s, layers=layers)


async def test_commits_append_and_a_waiter_is_woken_by_the_next_one(table):
    lease = opened(table)
    waiter = asyncio.ensure_future(wait(table, after=1))
    await asyncio.sleep(0)  # the waiter holds its event now
    assert not waiter.done()
    commit(table, lease, 2, [[3], [8, 9]])
    got, since = await asyncio.wait_for(waiter, 5)
    assert ids(got) == [[1, 2, 3], [7, 8, 9]] and since == [(2, 3), (1, 3)]
    # A D that lost that answer asks again with the epoch it has: the same blocks, at once.
    assert (await wait(table, after=1))[1] == [(2, 3), (1, 3)]
    assert (await wait(table, after=0))[1] == [(0, 3), (0, 3)]


async def test_a_retried_commit_is_answered_as_the_first_and_a_changed_one_refused(table):
    lease = opened(table)
    commit(table, lease, 2, [[3], [8]])
    commit(table, lease, 2, [[3], [8]])  # the same commit again (its answer was lost)
    assert ids(lease) == [[1, 2, 3], [7, 8]] and lease.commits.epoch == 2
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 2, [[4], [8]])
    assert e.value.reason == "COMMIT_CONFLICT" and e.value.metadata["commit_epoch"] == "2"
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 4, [[4], [9]])  # epoch 3 never came
    assert e.value.reason == "COMMIT_OUT_OF_ORDER"
    with pytest.raises(InvalidArgument) as e:
        commit(table, lease, 3, [[4]])  # one group of two
    assert e.value.reason == "INVALID_FIELD"
    assert ids(lease) == [[1, 2, 3], [7, 8]]  # nothing of the refused commits stayed


async def test_nothing_is_committed_after_the_final_commit(table):
    lease = opened(table)
    commit(table, lease, 2, [[3], []], final=True, num_tokens=80)
    commit(table, lease, 2, [[3], []], final=True, num_tokens=80)  # a retry of the final commit
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 3, [[4], []])
    assert e.value.reason == "LEASE_FINAL"
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 2, [[3], []], final=False)  # the final commit, sent back as not final
    assert e.value.reason == "COMMIT_CONFLICT"
    assert lease.digest == blocks_digest([np.array([1, 2, 3]), np.array([7])], 80)


async def test_a_chunk_committed_layer_by_layer_appends_once_then_only_raises_its_layers(table):
    lease = opened(table)  # 32 tokens in every layer
    commit(table, lease, 2, [[3], [8]], num_tokens=48, layers=(1, 2))
    log = lease.commits
    assert (log.partial, log.layers_done, log.whole_tokens, log.num_tokens) == ((1, 1), (1, 2), 32, 48)
    commit(table, lease, 2, [[3], [8]], num_tokens=48, layers=(1, 2))  # a retry
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 2, [[3], [8]], num_tokens=48, layers=(2, 2))  # epoch 2 again, other layers
    assert e.value.reason == "COMMIT_CONFLICT"
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 3, [[4], []], num_tokens=48, layers=(2, 2))  # more blocks mid-chunk
    assert e.value.reason == "COMMIT_CONFLICT" and e.value.metadata["field"] == "block_ids_per_group"
    with pytest.raises(FailedPrecondition) as e:
        commit(table, lease, 3, [[], []], num_tokens=48, layers=(0, 2))  # a layer taken back
    assert e.value.reason == "COMMIT_CONFLICT" and e.value.metadata["field"] == "layers_done"
    with pytest.raises(InvalidArgument) as e:
        commit(table, lease, 3, [[], []], num_tokens=48, layers=(2, 2), final=True)
    assert e.value.metadata["field"] == "layers_done"
    with pytest.raises(InvalidArgument) as e:
        commit(table, lease, 3, [[], []], num_tokens=48, layers=(2,))
    assert e.value.metadata["field"] == "layers_done"
    commit(table, lease, 3, [[], []], num_tokens=48, layers=(2, 2))
    assert (log.partial, log.layers_done, log.epoch) == ((1, 1), (2, 2), 3)
    # D waiting meanwhile hears of every commit; the whole one ends the chunk.
    waiter = asyncio.ensure_future(wait(table, after=3))
    await asyncio.sleep(0)
    commit(table, lease, 4, [[5], []], num_tokens=64, final=True)
    got, since = await asyncio.wait_for(waiter, 5)
    assert since == [(3, 4), (2, 2)] and (log.partial, log.layers_done, log.whole_tokens) == ((), (), 64)
    assert ids(got) == [[1, 2, 3, 5], [7, 8]] and lease.digest == blocks_digest(got.block_ids, 64)


async def test_a_d_that_reads_no_layers_sees_a_partial_chunk_only_once_whole(table):
    lease = opened(table)  # epoch 1: 32 tokens
    commit(table, lease, 2, [[3], [8]], num_tokens=48)
    older = asyncio.ensure_future(seen(table, after=2, layers=False))
    newer = asyncio.ensure_future(seen(table, after=2))
    await asyncio.sleep(0)
    commit(table, lease, 3, [[4], [9]], num_tokens=64, layers=(1, 1))
    _, epoch, since = await asyncio.wait_for(newer, 5)
    assert (epoch, since) == (3, [(3, 4), (2, 3)])
    commit(table, lease, 4, [[], []], num_tokens=64, layers=(2, 2))
    assert not older.done()  # partial commits do not end its wait (nor answer it empty)
    # A D asking anew after the epoch it has gets the whole part only, at once or once made whole.
    assert (await seen(table, after=1, layers=False))[1:] == (2, [(2, 3), (1, 2)])
    commit(table, lease, 5, [[], []], num_tokens=64)
    _, epoch, since = await asyncio.wait_for(older, 5)
    assert (epoch, since) == (5, [(3, 4), (2, 3)])
    waiting = asyncio.ensure_future(seen(table, after=5, layers=False, timeout_s=0.05))
    commit(table, lease, 6, [[5], []], num_tokens=80, layers=(1, 0))
    assert (await asyncio.wait_for(waiting, 5))[1:] == (5, [(4, 4), (3, 3)])  # its bound, nothing new seen


async def test_consumed_only_after_the_final_commit_and_over_its_blocks(table):
    lease = opened(table)
    with pytest.raises(FailedPrecondition) as e:
        table.claim("r", 3, token=lease.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=1, consumed=True)
    assert e.value.reason == "LEASE_NOT_FINAL"
    early = table.publish("early", [[4]], None, progressive=True)
    with pytest.raises(FailedPrecondition) as e:  # refused before it claims anything
        table.claim("early", 3, token=early.token, claim_id=OTHER, d_engine_id="D", d_tp_size=1, consumed=True)
    assert e.value.reason == "LEASE_NOT_FINAL" and early.state is LeaseState.OFFERED and not early.claims
    with pytest.raises(PermissionDenied) as e:  # and only to a holder of its token
        table.claim("early", 3, token="f" * 32, claim_id=OTHER, d_engine_id="D", d_tp_size=1, consumed=True)
    assert e.value.reason == "LEASE_TOKEN_MISMATCH"
    with pytest.raises(FailedPrecondition) as e:
        table.notify("r", NotifyKind.CONSUMED, [0], 3, claim_id=CLAIM)
    assert e.value.reason == "LEASE_NOT_FINAL"
    assert table.get("r").state is LeaseState.CLAIMED
    commit(table, lease, 2, [[3], [8]], final=True)
    with pytest.raises(InvalidArgument) as e:  # read by params of the blocks before the last chunk
        table.claim("r", 3, token=lease.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=1, consumed=True,
                    digest=blocks_digest([np.array([1, 2]), np.array([7])], 32))
    assert e.value.reason == "PARAMS_INCONSISTENT"
    assert table.claim("r", 3, token=lease.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=1, consumed=True,
                       digest=blocks_digest(lease.block_ids, 64)).state is LeaseState.CONSUMED


async def test_a_release_mid_stream_wakes_the_waiter_with_how_the_lease_ended(table):
    lease = opened(table)
    waiter = asyncio.ensure_future(wait(table, after=1))
    await asyncio.sleep(0)
    table.notify("r", NotifyKind.ABORTED, [], 3, claim_id=CLAIM)  # P's engine, or D, gives the request up
    with pytest.raises(FailedPrecondition) as e:
        await asyncio.wait_for(waiter, 5)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "aborted"
    with pytest.raises(FailedPrecondition) as e:  # P's engine commits a chunk after the release
        commit(table, lease, 2, [[3], []])
    assert e.value.reason == "LEASE_EXPIRED"
    assert table.leased_blocks == 0


async def test_committed_blocks_are_held_until_the_release_and_shared_ones_after(table):
    lease = opened(table, first=[[1], []])
    plain = table.publish("plain", [[3], []], None)  # another request shares block 3
    commit(table, lease, 2, [[3, 4], [5]])
    assert table.leased_blocks == 1 + 1 + 3
    events = table.subscribe()
    table.notify("r", NotifyKind.ABORTED, [], 3, claim_id=CLAIM)
    ev = await asyncio.wait_for(events.__anext__(), 5)
    assert [a.tolist() for a in ev.block_ids] == [[1, 3, 4], [5]]
    assert [a.tolist() for a in ev.free_block_ids] == [[1, 4], [5]]  # 3 is still the other lease's
    events.close()
    assert table.leased_blocks == 1 and table.get("plain") is plain


async def test_an_engine_withdrawing_mid_chunk_layer_by_layer_frees_its_blocks_and_ends_the_wait(table):
    lease = opened(table, first=[[1], []])
    commit(table, lease, 2, [[2, 3], [4]], layers=(1, 1))  # the chunk's blocks join at its first commit
    assert table.leased_blocks == 1 + 3
    waiter = asyncio.ensure_future(wait(table, after=2))
    await asyncio.sleep(0)
    # (the engine takes its blocks back itself: no release is announced for a withdrawal)
    assert table.notify("r", NotifyKind.ABORTED, [], 3, token=lease.token, withdraw=True)[0] is LeaseState.ABORTED
    with pytest.raises(FailedPrecondition) as e:
        await asyncio.wait_for(waiter, 5)
    assert e.value.reason == "LEASE_EXPIRED" and table.leased_blocks == 0
    with pytest.raises(FailedPrecondition) as e:  # the rest of the chunk comes too late
        commit(table, lease, 3, [[], []], layers=(2, 2))
    assert e.value.reason == "LEASE_EXPIRED"


async def test_waits_are_for_the_claimant_of_a_progressive_lease_only(table):
    lease = opened(table)
    with pytest.raises(PermissionDenied) as e:
        await wait(table, claim_id=OTHER)
    assert e.value.reason == "LEASE_NOT_OWNER"
    whole = table.publish("whole", [[1]], None)
    table.claim("whole", 3, token=whole.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=1)
    with pytest.raises(FailedPrecondition) as e:
        await wait(table, rid="whole")
    assert e.value.reason == "LEASE_NOT_PROGRESSIVE"
    with pytest.raises(FailedPrecondition) as e:
        commit(table, whole, 2, [[2]])
    assert e.value.reason == "LEASE_NOT_PROGRESSIVE"
    with pytest.raises(FailedPrecondition) as e:  # an epoch the lease never reached
        await wait(table, after=5)
    assert e.value.reason == "COMMIT_OUT_OF_ORDER"
    assert lease.commits.epoch == 1


async def test_a_wait_with_nothing_committed_ends_empty_at_its_bound_and_renews_the_lease(table):
    lease = opened(table)
    before = lease.expires_at
    got, since = await wait(table, after=1, timeout_s=0.0)  # the bound: nothing came
    assert since == [(2, 2), (1, 1)] and got is lease
    assert lease.expires_at >= before
    assert table.commit_waits.waiting == 0


async def test_waiters_end_when_the_table_closes():
    t = LeaseTable(epoch=3, hosted_ranks=[0], tp_size=1, default_ttl_s=5.0, max_ttl_s=60.0)
    t.start()
    opened(t)
    waiter = asyncio.ensure_future(wait(t, after=1))
    await asyncio.sleep(0)
    await t.close()
    with pytest.raises(Exception) as e:
        await asyncio.wait_for(waiter, 5)
    assert getattr(e.value, "reason", "") == "SHUTTING_DOWN"


async def test_commits_count_against_the_servers_block_quota():
    t = LeaseTable(epoch=3, hosted_ranks=[0], tp_size=1, default_ttl_s=5.0, max_ttl_s=60.0, max_leased_blocks=4)
    t.start()
    try:
        lease = opened(t)  # 3 block ids
        with pytest.raises(Exception) as e:
            commit(t, lease, 2, [[3], [8]])  # 5 would pass 4
        assert getattr(e.value, "reason", "") == "TOO_MANY_LEASED_BLOCKS"
        assert ids(lease) == [[1, 2], [7]] and lease.commits.epoch == 1 and t.leased_blocks == 3
        commit(t, lease, 2, [[3], []])
        assert t.leased_blocks == 4
    finally:
        await t.close()


async def test_the_engine_ends_its_growing_lease_claimed_or_not_but_not_a_final_one(table):
    """An abort on P before the last chunk: the engine withdraws the lease even though D
    claimed it (D's wait hears LEASE_EXPIRED, its confirm is refused); once final, the lease
    is D's to finish, as a whole lease is."""
    lease = opened(table)
    waiter = asyncio.ensure_future(wait(table, after=1))
    await asyncio.sleep(0)
    with pytest.raises(PermissionDenied) as e:  # the token is the engine's proof
        table.notify("r", NotifyKind.ABORTED, [], 3, token="x" * 32, withdraw=True)
    assert e.value.reason == "LEASE_TOKEN_MISMATCH" and table.get("r") is not None
    assert table.notify("r", NotifyKind.ABORTED, [], 3, token=lease.token, withdraw=True)[0] is LeaseState.ABORTED
    with pytest.raises(FailedPrecondition) as e:
        await asyncio.wait_for(waiter, 5)
    assert e.value.reason == "LEASE_EXPIRED" and table.leased_blocks == 0
    final = opened(table, "f")
    commit(table, final, 2, [[3], []], final=True)
    with pytest.raises(PermissionDenied) as e:
        table.notify("f", NotifyKind.ABORTED, [], 3, token=final.token, withdraw=True)
    assert e.value.reason == "LEASE_NOT_OWNER" and table.get("f") is not None


async def test_an_engine_that_freed_the_blocks_revokes_even_a_final_claimed_lease(table):
    """vLLM preempted the request after its last chunk (its blocks are freed, and may be
    refilled by the next forward): even_final takes the claimed, final lease back, and the
    claimant's confirm is refused -- what it read is never used."""
    final = opened(table, "f")
    commit(table, final, 2, [[3], []], final=True)
    with pytest.raises(PermissionDenied):  # the token is still the engine's proof
        table.notify("f", NotifyKind.ABORTED, [], 3, token="x" * 32, withdraw=True, even_final=True)
    state, _ = table.notify("f", NotifyKind.ABORTED, [], 3, token=final.token, withdraw=True, even_final=True)
    assert state is LeaseState.ABORTED and table.get("f") is None and table.leased_blocks == 0
    state, _ = table.notify("f", NotifyKind.CONSUMED, [0], 3, claim_id=CLAIM)
    assert state is LeaseState.ABORTED, "the claimant's confirm must not find a consumed lease"


@pytest.fixture
async def pumped():
    """A table whose on_live_change edges are recorded: +1 when the first lease a D may be
    reading goes live, -1 when the last one is released or goes quiet (the data plane's
    pump runs between)."""
    edges: list[int] = []
    t = LeaseTable(epoch=3, hosted_ranks=[0], tp_size=1, default_ttl_s=5.0, max_ttl_s=60.0,
                   on_live_change=edges.append)
    t.start()
    yield t, edges
    await t.close()


async def wait_done(table, after, claim_id=CLAIM, reads_done=True):
    got, _, since = await table.wait_commit("r", 3, claim_id=claim_id, d_engine_id="D", after_epoch=after,
                                            timeout_s=5.0, reads_done=reads_done)
    return got, since


async def test_a_growing_lease_needs_the_pump_only_until_its_claimant_waits_with_its_reads_done(pumped):
    table, edges = pumped
    lease = opened(table)
    assert edges == [+1]
    await wait_done(table, after=0)  # answered at once, with the opening chunk: D reads it now
    assert edges == [+1]
    waiter = asyncio.ensure_future(wait_done(table, after=1))
    await asyncio.sleep(0)  # the waiter holds its event now
    assert edges == [+1, -1]  # D read all it was handed and waits: nobody reads the lease
    commit(table, lease, 2, [[3], [8]])
    await asyncio.wait_for(waiter, 5)
    assert edges == [+1, -1, +1]  # the answer handed D a chunk to read
    # A D that does not say its READs ended (an older one) keeps the pump running.
    older = asyncio.ensure_future(wait_done(table, after=2, reads_done=False))
    await asyncio.sleep(0)
    assert not older.done() and edges == [+1, -1, +1]
    commit(table, lease, 3, [[4], [9]], final=True)
    await asyncio.wait_for(older, 5)
    table.notify("r", NotifyKind.CONSUMED, [0], 3, claim_id=CLAIM)
    assert edges == [+1, -1, +1, -1]


async def test_a_whole_lease_keeps_the_pump_and_a_quiet_lease_released_leaves_no_second_edge(pumped):
    table, edges = pumped
    whole = table.publish("w", [[5]], None, num_tokens=16)
    lease = opened(table)
    waiter = asyncio.ensure_future(wait_done(table, after=1))
    await asyncio.sleep(0)
    assert edges == [+1]  # the growing lease is quiet, but D may read the whole one at any time
    table.notify("w", NotifyKind.ABORTED, [], 3, token=whole.token)
    assert edges == [+1, -1]
    table.notify("r", NotifyKind.ABORTED, [], 3, token=lease.token, withdraw=True)  # P's engine takes it back
    with pytest.raises(FailedPrecondition):
        await asyncio.wait_for(waiter, 5)
    assert edges == [+1, -1]  # it was quiet already: no edge for its release


async def test_a_second_claimant_makes_a_quiet_lease_readable_again(pumped):
    table, edges = pumped
    lease = table.publish("r", [[1, 2], [7]], None, num_tokens=32, progressive=True)
    table.claim("r", 3, token=lease.token, claim_id=CLAIM, d_engine_id="D", d_tp_size=2, d_ranks=[0])
    waiter = asyncio.ensure_future(wait_done(table, after=1))
    await asyncio.sleep(0)
    assert edges == [+1, -1]
    table.claim("r", 3, token=lease.token, claim_id=OTHER, d_engine_id="D", d_tp_size=2, d_ranks=[1])
    assert edges == [+1, -1, +1]  # OTHER has read nothing yet, and may read what is committed at once
    waiter.cancel()
