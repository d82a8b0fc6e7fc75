"""LeaseTable: states, expiry order, claims, idempotent notifications, release events."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, PermissionDenied, Unavailable
from kvsvc.leases.table import LeaseState, LeaseTable, NotifyKind, SubscriberBehind, Tombstone


@pytest.fixture
async def table():
    edges: list[int] = []  # on_live_change: the data plane's pump runs while a lease lives
    t = LeaseTable(epoch=7, hosted_ranks=[0, 1], tp_size=2, default_ttl_s=5.0, max_ttl_s=60.0,
                   on_live_change=edges.append)
    t.claims = edges  # type: ignore[attr-defined]
    t.start()
    yield t
    await t.close()


async def collect(table, n, timeout=3.0):
    out = []
    sub = table.subscribe()

    async def take():
        async for ev in sub:
            out.append(ev)
            if len(out) == n:
                return

    try:
        await asyncio.wait_for(take(), timeout)
    finally:
        sub.close()
    return out


CLAIM_A = "a" * 32
CLAIM_B = "b" * 32
CONSUMED, ABORTED, HEARTBEAT = NotifyKind.CONSUMED, NotifyKind.ABORTED, NotifyKind.HEARTBEAT


def claim(table, rid, claim_id=CLAIM_A, *, epoch=7, engine="D", tp=2, ranks=(), token=None, consumed=False):
    token = table.get(rid).token if token is None and table.get(rid) else token or ""
    return table.claim(rid, epoch, token=token, claim_id=claim_id, d_engine_id=engine, d_tp_size=tp, d_ranks=ranks,
                       consumed=consumed)


async def test_consumed_after_every_d_rank(table):
    watcher = asyncio.ensure_future(collect(table, 1))
    await asyncio.sleep(0)  # the watcher task subscribes
    table.publish("r", [[1, 2]], None)
    claim(table, "r", tp=4)
    assert table.notify("r", CONSUMED, [0, 1], 7, claim_id=CLAIM_A) == (LeaseState.CLAIMED, [2, 3])
    assert table.notify("r", CONSUMED, [2, 3], 7, claim_id=CLAIM_A) == (LeaseState.CONSUMED, [])
    (ev,) = await watcher
    assert (ev.request_id, ev.reason, [g.tolist() for g in ev.block_ids]) == ("r", LeaseState.CONSUMED, [[1, 2]])
    assert [g.tolist() for g in ev.free_block_ids] == [[1, 2]]
    assert table.notify("r", CONSUMED, [0], 7, claim_id=CLAIM_A) == (LeaseState.CONSUMED, [])  # duplicate: harmless
    assert table.claims == [1, -1] and table.live_count == 0


async def test_expiry_does_not_assume_publish_order(table):
    watcher = asyncio.ensure_future(collect(table, 1))
    await asyncio.sleep(0)  # the watcher task subscribes
    table.publish("long", [[1]], 0.4)
    short = table.publish("short", [[2]], 0.1)
    table.notify("short", HEARTBEAT, [], 7, token=short.token)  # extends "short" past "long" (default ttl 5 s)
    (ev,) = await watcher
    assert (ev.request_id, ev.reason) == ("long", LeaseState.EXPIRED)
    assert table.get("short").state is LeaseState.OFFERED


async def test_claim_refusals(table):
    token = table.publish("r", [[1]], 0.05).token
    await asyncio.sleep(0.15)
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "r", token=token)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "expired"
    table.publish("q", [[1]], None)
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "q", epoch=8)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["server_epoch"] == "7"
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "q", tp=3)
    assert e.value.reason == "TP_NOT_DIVISIBLE"
    with pytest.raises(PermissionDenied) as e:
        claim(table, "q", token="0" * 32)
    assert e.value.reason == "LEASE_TOKEN_MISMATCH"
    claim(table, "q")
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "q", CLAIM_B, engine="other")
    assert e.value.reason == "LEASE_CLAIMED"


async def test_a_lease_has_one_owner_per_d_rank(table):
    table.publish("r", [[1]], None)
    claim(table, "r")
    claim(table, "r")  # the same claim again (a retried ClaimLease): granted, nothing changes
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "r", CLAIM_B)  # a second transfer of the same request
    assert e.value.reason == "LEASE_CLAIMED" and e.value.metadata["ranks"] == "0,1"
    for kind in (CONSUMED, ABORTED, HEARTBEAT):
        with pytest.raises(PermissionDenied) as e:
            table.notify("r", kind, [0, 1], 7, claim_id=CLAIM_B)  # not the owner
        assert e.value.reason == "LEASE_NOT_OWNER"
        with pytest.raises(PermissionDenied):
            table.notify("r", kind, [0, 1], 7, token=table.get("r").token)  # the token no longer suffices
    assert table.get("r").state is LeaseState.CLAIMED
    assert table.notify("r", CONSUMED, [0, 1], 7, claim_id=CLAIM_A) == (LeaseState.CONSUMED, [])


async def test_disjoint_claims_of_one_engine_split_over_servers(table):
    table.publish("r", [[1]], None)
    claim(table, "r", CLAIM_A, ranks=[0])
    claim(table, "r", CLAIM_B, ranks=[1])
    with pytest.raises(InvalidArgument) as e:
        table.notify("r", CONSUMED, [1], 7, claim_id=CLAIM_A)  # only its own ranks
    assert e.value.reason == "RANK_NOT_CLAIMED"
    assert table.notify("r", CONSUMED, [0], 7, claim_id=CLAIM_A) == (LeaseState.CLAIMED, [1])
    assert table.notify("r", CONSUMED, [1], 7, claim_id=CLAIM_B) == (LeaseState.CONSUMED, [])


async def test_unclaimed_lease_needs_its_token(table):
    lease = table.publish("r", [[1]], None)
    with pytest.raises(PermissionDenied) as e:
        table.notify("r", ABORTED, [], 7)  # a request id alone grants nothing
    assert e.value.reason == "LEASE_TOKEN_MISMATCH"
    with pytest.raises(FailedPrecondition) as e:
        table.notify("r", CONSUMED, [0], 7, token=lease.token)
    assert e.value.reason == "LEASE_NOT_CLAIMED"
    assert table.notify("r", ABORTED, [], 7, token=lease.token)[0] is LeaseState.ABORTED


async def test_publish_refusals(table):
    table.publish("r", [[1]], None)
    with pytest.raises(KvsvcError) as e:
        table.publish("r", [[1]], None)
    assert e.value.reason == "LEASE_EXISTS" and e.value.code is ErrorCode.ALREADY_EXISTS
    with pytest.raises(InvalidArgument) as e:
        table.publish("x", [[1]], 61.0)
    assert e.value.reason == "LEASE_TTL_TOO_LONG"
    with pytest.raises(InvalidArgument):
        table.publish("", [[1]], None)


async def test_live_leases_are_capped_and_tombstones_keep_no_blocks():
    t = LeaseTable(epoch=1, hosted_ranks=[0], tp_size=1, max_live=3)
    for i in range(3):
        t.publish(f"r{i}", [list(range(1000))], None)
    with pytest.raises(KvsvcError) as e:
        t.publish("one-more", [[1]], None)
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TOO_MANY_LEASES")
    t.notify("r0", ABORTED, [], 1, token=t.get("r0").token)
    assert isinstance(t._dead["r0"], Tombstone) and not hasattr(t._dead["r0"], "block_ids")
    t.publish("one-more", [[1]], None)  # room again


async def test_drain_refuses_publishes_and_waits_for_claims(table):
    table.publish("r", [[1]], None)
    claim(table, "r")
    drain = asyncio.ensure_future(table.drain(5.0))
    await asyncio.sleep(0.05)
    assert not drain.done(), "a claimed lease may still be read"
    with pytest.raises(Unavailable) as e:
        table.publish("late", [[2]], None)
    assert e.value.reason == "SHUTTING_DOWN"
    table.notify("r", CONSUMED, [0, 1], 7, claim_id=CLAIM_A)
    assert await asyncio.wait_for(drain, 1.0) == 0


async def test_a_drain_that_runs_out_holds_claims_to_their_deadlines_without_renewal():
    """D may answer on its claim's deadline alone (RELIABILITY.md, promise 1): a server whose
    drain ran out stops only once its claimed leases reached the deadlines D was told, and
    no renewal moves them meanwhile; the unclaimed lease is not waited for."""
    t = LeaseTable(epoch=7, hosted_ranks=[0], tp_size=1, default_ttl_s=0.3, max_ttl_s=60.0)
    t.start()
    try:
        t.publish("r", [[1]], None)
        t.publish("idle", [[2]], None)
        lease = claim(t, "r", tp=1)
        told = lease.expires_at  # what the claim's answer told D
        sub = t.subscribe()
        drain = asyncio.ensure_future(t.drain(0.0))
        for _ in range(100):  # loop turns (no clock) until the drain ran out and holds the claim
            if t._held_to_deadlines:
                break
            await asyncio.sleep(0)
        assert t._held_to_deadlines
        t.notify("r", HEARTBEAT, [], 7, claim_id=CLAIM_A)
        assert t.get("r").expires_at == told, "a renewal moved a deadline D may rely on"
        assert await asyncio.wait_for(drain, 10) == 1  # one lease was still claimed when it ran out
        assert t.final_state("r") is LeaseState.EXPIRED, "the drain ended before the claim did"
        async for ev in sub:
            if ev.request_id == "r":
                break
        assert t.final_state("r") is LeaseState.EXPIRED and ev.released_unix_ms > 0
        assert time.monotonic() >= told, "released before the deadline D was told"
    finally:
        await t.close()


async def test_abort_releases_and_epoch_mismatch_reports_expired(table):
    table.publish("r", [[1]], None)
    claim(table, "r", tp=1)
    assert table.notify("r", ABORTED, [], 7, claim_id=CLAIM_A)[0] is LeaseState.ABORTED
    assert table.notify("r", CONSUMED, [0], 99, claim_id=CLAIM_A) == (LeaseState.EXPIRED, [])
    assert table.notify("nope", CONSUMED, [0], 7) == (None, [])
    assert table.claims == [1, -1]


async def test_claim_rank_out_of_range(table):
    table.publish("r", [[1]], None)
    with pytest.raises(InvalidArgument) as e:
        claim(table, "r", ranks=[5])
    assert e.value.reason == "RANK_OUT_OF_RANGE"


async def test_withdraw_ends_an_unclaimed_lease_without_a_release_event(table):
    sub = table.subscribe()
    try:
        lease = table.publish("w", [[1]], None)
        with pytest.raises(PermissionDenied):
            table.notify("w", ABORTED, [], 7, withdraw=True)  # needs the token
        assert table.notify("w", ABORTED, [], 7, token=lease.token, withdraw=True)[0] is LeaseState.ABORTED
        assert table.live_count == 0 and sub.held_bytes == 0, "a withdrawn lease was never handed out"
        claimed = table.publish("c", [[2]], None)
        claim(table, "c")
        with pytest.raises(PermissionDenied) as e:
            table.notify("c", ABORTED, [], 7, token=claimed.token, withdraw=True)
        assert e.value.reason == "LEASE_NOT_OWNER"
    finally:
        sub.close()


def claim_consumed(table, rid, claim_id=CLAIM_A, **kw):
    return claim(table, rid, claim_id, consumed=True, **kw)


async def test_a_consumed_claim_releases_in_one_step(table):
    watcher = asyncio.ensure_future(collect(table, 1))
    await asyncio.sleep(0)
    table.publish("r", [[1]], None)
    lease = claim_consumed(table, "r")
    assert lease.state is LeaseState.CONSUMED and table.get("r") is None
    assert (await watcher)[0].reason is LeaseState.CONSUMED
    assert table.claimed_count == 0 and table.claims == [+1, -1]  # type: ignore[attr-defined]


async def test_a_retried_claim_and_consumed_is_answered_as_the_first(table):
    """Its answer was lost (the stream broke): the same claim again is told CONSUMED (its READs
    were good), not LEASE_EXPIRED; any other claim, or another epoch, is still refused."""
    table.publish("r", [[1]], None)
    token = table.get("r").token
    assert claim_consumed(table, "r").state is LeaseState.CONSUMED
    assert claim_consumed(table, "r", token=token) is None  # the retry: nothing changes, no error
    assert table.final_state("r") is LeaseState.CONSUMED
    with pytest.raises(FailedPrecondition) as e:
        claim_consumed(table, "r", CLAIM_B, token=token)
    assert e.value.reason == "LEASE_EXPIRED"
    with pytest.raises(FailedPrecondition):
        claim_consumed(table, "r", token=token, epoch=8)
    with pytest.raises(FailedPrecondition):  # a plain claim (no consumed) is not a retry of one
        claim(table, "r", token=token)
    table.publish("x", [[2]], None)
    x = table.get("x")
    table.notify("x", ABORTED, [], 7, token=x.token)
    with pytest.raises(FailedPrecondition):  # aborted, not consumed by this claim
        claim_consumed(table, "x", token=x.token)


async def test_params_of_a_released_lease_never_claim_a_later_lease_of_the_same_id(table):
    """An engine that derives ids and tokens (SGLang: from its bootstrap room) leases the
    same id again after the first lease was released: params that carry the first lease's
    serial are refused (LEASE_EXPIRED, 'replaced'), the second lease's serial or none passes."""
    first = table.publish("room-7", [[3]], None, token="t" * 32)
    table.notify("room-7", ABORTED, [], 7, token=first.token)
    second = table.publish("room-7", [[3]], None, token="t" * 32)  # same id, token and blocks
    assert second.serial > first.serial
    with pytest.raises(FailedPrecondition) as e:
        table.claim("room-7", 7, token="t" * 32, claim_id=CLAIM_A, d_engine_id="D", d_tp_size=2,
                    serial=first.serial)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "replaced"
    assert table.get("room-7").state is LeaseState.OFFERED and not table.get("room-7").claims
    assert table.claim("room-7", 7, token="t" * 32, claim_id=CLAIM_A, d_engine_id="D", d_tp_size=2,
                       serial=second.serial).state is LeaseState.CLAIMED


async def test_the_pump_runs_from_the_first_live_lease_to_the_last_release(table):
    """A D may read any live lease (it claims after reading): the pump hears of the table's
    first lease and of its last release, nothing in between."""
    table.publish("a", [[1]], None)
    table.publish("b", [[2]], None)
    claim(table, "b")  # a claim while reading changes nothing: the pump already runs
    assert table.claims == [+1]  # type: ignore[attr-defined]
    claim_consumed(table, "a")
    assert table.claims == [+1]  # type: ignore[attr-defined]  # b still lives
    table.notify("b", CONSUMED, [0, 1], 7, claim_id=CLAIM_A)
    assert table.claims == [+1, -1]  # type: ignore[attr-defined]
    lease = table.publish("w", [[3]], None)  # withdrawn unclaimed: an edge each way as well
    table.notify("w", ABORTED, [], 7, token=lease.token, withdraw=True)
    table.publish("x", [[4]], 0.05)
    await asyncio.sleep(0.3)  # expired by the reaper
    assert table.claims == [+1, -1, +1, -1, +1, -1] and table.live_count == 0  # type: ignore[attr-defined]


async def test_a_consumed_claim_of_some_d_ranks_waits_for_the_others(table):
    """One D engine over two servers: each reports its own ranks with its own claim."""
    table.publish("r", [[1]], None)
    assert claim_consumed(table, "r", CLAIM_A, tp=2, ranks=[0]).state is LeaseState.CLAIMED
    assert table.claims == [+1]  # type: ignore[attr-defined]  # rank 1 may still be reading
    with pytest.raises(FailedPrecondition) as e:  # rank 0 is owned: a second reader of it is refused
        claim_consumed(table, "r", CLAIM_B, tp=2, ranks=[0, 1])
    assert e.value.reason == "LEASE_CLAIMED"
    assert claim_consumed(table, "r", CLAIM_B, tp=2, ranks=[1]).state is LeaseState.CONSUMED
    assert table.claims == [+1, -1] and table.claimed_count == 0  # type: ignore[attr-defined]


async def test_a_consumed_claim_is_refused_once_the_lease_was_released(table):
    """The grant is the proof that the bytes read were the published ones: a lease aborted,
    expired or consumed in the meantime must refuse it, and refuse it for good."""
    table.publish("aborted", [[1]], None)
    token = table.get("aborted").token
    table.notify("aborted", ABORTED, [], 7, token=token)
    table.publish("short", [[2]], 0.05)
    short_token = table.get("short").token
    table.publish("twice", [[3]], None)
    twice_token = table.get("twice").token
    claim_consumed(table, "twice", CLAIM_A)
    await asyncio.sleep(0.1)
    for rid, tok, state in (("aborted", token, "aborted"), ("short", short_token, "expired"),
                            ("twice", twice_token, "consumed")):
        with pytest.raises(FailedPrecondition) as e:
            claim_consumed(table, rid, CLAIM_B, token=tok)
        assert (e.value.reason, e.value.metadata["state"]) == ("LEASE_EXPIRED", state), rid
    table.publish("owned", [[4]], None)
    claim(table, "owned", CLAIM_A)  # a long read's claim holds it
    with pytest.raises(FailedPrecondition) as e:
        claim_consumed(table, "owned", CLAIM_B)
    assert e.value.reason == "LEASE_CLAIMED"
    assert table.get("owned").state is LeaseState.CLAIMED


def _digest_by_hand(groups, num_tokens):
    """ClaimLeaseRequest.blocks_digest as its proto comment spells it, written out again."""
    import hashlib
    import struct

    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<q", num_tokens))
    for ids in groups:
        h.update(struct.pack("<q", len(ids)) + b"".join(struct.pack("<q", i) for i in ids))
    return h.digest()


async def test_a_claim_for_other_blocks_than_the_lease_holds_is_refused(table):
    table.publish("r", [[1, 2], [7]], None, num_tokens=20)
    token = table.get("r").token
    for groups, tokens in (([[1, 3], [7]], 20), ([[1, 2], [7]], 21), ([[1, 2]], 20), ([[2, 1], [7]], 20)):
        with pytest.raises(InvalidArgument) as e:
            table.claim("r", 7, token=token, claim_id=CLAIM_A, d_engine_id="D", d_tp_size=2,
                        digest=_digest_by_hand(groups, tokens))
        assert e.value.reason == "PARAMS_INCONSISTENT", (groups, tokens)
    assert table.get("r").state is LeaseState.OFFERED and table.claimed_count == 0
    lease = table.claim("r", 7, token=token, claim_id=CLAIM_A, d_engine_id="D", d_tp_size=2,
                        digest=_digest_by_hand([[1, 2], [7]], 20), consumed=True)
    assert lease.state is LeaseState.CONSUMED  # no ranks named: all of the D engine's, reported at once


async def test_a_block_in_two_live_leases_is_free_only_with_the_last_release():
    """Round three, 12: two live leases may share blocks (a prefix two requests share); a
    release reports as free only the blocks no other live lease holds, so an engine that
    reuses what a release frees never overwrites a block another reader is promised."""
    t = LeaseTable(epoch=1, hosted_ranks=[0], tp_size=1)
    sub = t.subscribe()
    a = t.publish("a", [[1, 2, 3, 3], [7]], None)  # a block listed twice in one lease counts twice
    b = t.publish("b", [[3, 4], [7, 8]], None)
    assert t.leased_blocks == 9
    t.notify("a", ABORTED, [], 1, token=a.token)
    ev = await anext(sub)
    assert [g.tolist() for g in ev.block_ids] == [[1, 2, 3, 3], [7]]
    assert [g.tolist() for g in ev.free_block_ids] == [[1, 2], []], "3 and 7 are still b's"
    t.notify("b", ABORTED, [], 1, token=b.token)
    ev = await anext(sub)
    assert [g.tolist() for g in ev.free_block_ids] == [[3, 4], [7, 8]]
    assert t.leased_blocks == 0
    withdrawn = t.publish("w", [[9]], None)  # a withdrawn lease lets go of its blocks too
    t.notify("w", ABORTED, [], 1, token=withdrawn.token, withdraw=True)
    c = t.publish("c", [[9]], None)
    t.notify("c", ABORTED, [], 1, token=c.token)
    assert [g.tolist() for g in (await anext(sub)).free_block_ids] == [[9]]


async def test_leased_blocks_are_bounded_in_bytes():
    """Round three, 4: the cap counts block ids, not only leases, and a lease keeps its ids in
    4 bytes each (a list of ints cost ~36: a 4,096-block lease was ~160 KiB)."""
    import tracemalloc

    t = LeaseTable(epoch=1, hosted_ranks=[0], tp_size=1, max_leased_blocks=3 * 4096)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3):
            t.publish(f"r{i}", [list(range(4096))], None)
        per_lease = (tracemalloc.get_traced_memory()[0] - before) / 3
    finally:
        tracemalloc.stop()
    assert per_lease < 24 * 1024, f"{per_lease / 1024:.0f} KiB per 4,096-block lease"
    with pytest.raises(KvsvcError) as e:
        t.publish("one-more", [[1]], None)
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TOO_MANY_LEASED_BLOCKS")
    assert e.value.metadata == {"leased_blocks": "12288", "asked": "1", "max_leased_blocks": "12288"}
    t.notify("r0", ABORTED, [], 1, token=t.get("r0").token)
    t.publish("one-more", [[1]], None)  # room again


async def test_a_subscriber_that_stops_reading_is_ended_and_what_it_held_is_freed():
    """Round three, 3: releases held for a subscriber that does not read are bounded in bytes;
    past the bound it is ended (SubscriberBehind) and its backlog dropped at once, while a
    subscriber that reads is untouched."""
    t = LeaseTable(epoch=1, hosted_ranks=[0], tp_size=1, watch_backlog_bytes=256 * 1024)
    stalled, reader = t.subscribe(), t.subscribe()
    got = 0
    for i in range(100):  # ~8.5 KiB each with its free ids: ~850 KiB in all
        lease = t.publish(f"r{i}", [list(range(1000))], None)
        t.notify(f"r{i}", ABORTED, [], 1, token=lease.token)
        await anext(reader)
        got += 1
        assert stalled.held_bytes <= 256 * 1024
    assert got == 100 and stalled.held_bytes == 0
    with pytest.raises(SubscriberBehind) as e:
        await anext(stalled)
    assert e.value.limit_bytes == 256 * 1024
    assert stalled not in t._watchers and reader in t._watchers


async def test_one_d_engine_cannot_hold_every_lease():
    """Round three, 4 (fairness): claims extend leases and heartbeats keep them, so one D
    engine is held to max_claims_per_engine claimed leases; another engine still claims."""
    t = LeaseTable(epoch=1, hosted_ranks=[0], tp_size=1, max_claims_per_engine=2)
    for i in range(4):
        t.publish(f"r{i}", [[i]], None)
    claim(t, "r0", engine="greedy", tp=1, epoch=1)
    claim(t, "r1", engine="greedy", tp=1, epoch=1)
    with pytest.raises(KvsvcError) as e:
        claim(t, "r2", engine="greedy", tp=1, epoch=1)
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TOO_MANY_CLAIMS")
    assert e.value.metadata == {"engine_id": "greedy", "max_claims_per_engine": "2"}
    assert t.get("r2").state is LeaseState.OFFERED and not t.get("r2").claims, "a refused claim changes nothing"
    claim(t, "r3", engine="other", tp=1, epoch=1)
    claim(t, "r0", engine="greedy", tp=1, epoch=1)  # a repeat of a held claim is no new one
    t.notify("r0", CONSUMED, [0], 1, claim_id=CLAIM_A)
    claim(t, "r2", engine="greedy", tp=1, epoch=1)  # room again once one ended


# ---- leases made after their params were handed out (lease_pending) -------------------

TOKEN = "ab" * 16


async def test_an_abort_before_the_publish_refuses_that_publish(table):
    """D (or a router) gave the request up before the engine's server leased it: the later
    publish under the same token is refused, so the engine frees the blocks at once."""
    assert table.notify("early", ABORTED, [], 7, token=TOKEN) == (None, [])
    with pytest.raises(FailedPrecondition) as e:
        table.publish("early", [[1]], None, token=TOKEN)
    assert e.value.reason == "LEASE_ABORTED" and e.value.metadata["request_id"] == "early"
    assert table.live_count == 0 and table.leased_blocks == 0
    # Only that token's publish: an abort with a wrong token changes nothing.
    table.notify("other", ABORTED, [], 7, token="cd" * 16)
    assert table.publish("other", [[2]], None, token=TOKEN).token == TOKEN
    # And only once: the refusal used it up.
    assert table.publish("early", [[3]], None, token=TOKEN).state is LeaseState.OFFERED


async def test_a_refused_lease_leaves_a_tombstone_a_waiting_claim_reads(table):
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "never")
    assert e.value.metadata["state"] == "unknown", "not made yet: a lease_pending claim asks again"
    table.refuse("never", TOKEN)
    with pytest.raises(FailedPrecondition) as e:
        claim(table, "never")
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "aborted"
    # A live lease of that id (another token) is not touched.
    live = table.publish("live", [[4]], None)
    table.refuse("live", TOKEN)
    assert table.get("live") is live and live.state is LeaseState.OFFERED
