"""Params handed out before the lease exists (lease_pending), against real servers and NIXL.

An engine may mint the lease token and the params where its requests finish and lease the
blocks on its servers a moment later (the vLLM connector does: no network call on vLLM's
engine thread). A D that arrives first waits for the lease within its deadline; a lease the
engine could not make, or one given up before it was made, fails D at once; params without
lease_pending keep failing at once (the control).

D waits on P, not by asking again: its one claim says how long it will wait (wait_ms) and
P answers it when the lease is made (leases/arrivals.py), on either LeaseChannel carrier,
while the calls behind it on the same stream are answered as usual. Waiters are bounded;
what D gives up on (its deadline, a cancel, a refusal to wait) P is told, so that the
lease, made later, is refused instead of held to its TTL.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.client import AsyncClient
from kvsvc.client.leases import LEASE_NOT_YET_MADE, abort_published, heartbeat_published
from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError
from kvsvc.leases.records import LeaseState
from kvsvc.service import prefill
from kvsvc.service.server import RunningServer
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import in_process_pair, lease_ended, same_block_bytes
from tests.e2e.test_read_then_claim import engines

TOKEN = "5e" * 16
CARRIERS = {"socket": {}, "grpc": {"lease_socket": False}}


class ClaimsSeen:
    """What P sees of D's claims: each LeaseCall claim it is sent, and an event each time a
    claim starts (and one when it stops) waiting for its lease."""

    def __init__(self, p: RunningServer) -> None:
        self.claims = 0
        self.waiting = asyncio.Event()
        self.stopped_waiting = asyncio.Event()
        answers, arrivals = p.servicer.lease_answers, p.node.leases.arrivals
        answer, wait = answers.answer, arrivals.wait

        def counted(call, names):
            self.claims += call.WhichOneof("call") == "claim"
            return answer(call, names)

        async def seen(request_id, engine_id, timeout_s):
            self.waiting.set()
            try:
                return await wait(request_id, engine_id, timeout_s)
            finally:
                self.stopped_waiting.set()

        answers.answer, arrivals.wait = counted, seen


def _params(p: RunningServer, request_id: str, block: int, pending: bool = True) -> pb.TransferParams:
    """What the engine hands out before its server leases anything."""
    return pb.TransferParams(
        remote_address=f"127.0.0.1:{p.port}", remote_engine_id=p.node.config.engine_id, remote_request_id=request_id,
        remote_block_ids_per_group=[pb.BlockIds(block_ids=[block])], remote_epoch=p.node.epoch, remote_tp_size=1,
        lease_token=TOKEN, lease_pending=pending)


async def _lease(p: RunningServer, request_id: str, block: int) -> None:
    """The engine's server leases the blocks under the minted token (in process, as the connector does)."""
    await prefill.publish(p.node, pb.PublishBlocksRequest(request_id=request_id, lease_token=TOKEN,
                                                          block_ids_per_group=[pb.BlockIds(block_ids=[block])]),
                          p.siblings)


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
async def test_a_d_that_arrives_before_the_lease_waits_on_p_with_one_claim(carrier):
    async with in_process_pair("pend", **CARRIERS[carrier]) as (p, d), engines(p, d) as (_pc, dc, pe, de):
        seen = ClaimsSeen(p)
        pe.fill([[3]])
        params = _params(p, "late", 3)
        call = asyncio.ensure_future(dc.transfer("d-late", params, [[4]]))
        await asyncio.wait_for(seen.waiting.wait(), 30)  # D has read, and its claim waits on P
        assert not call.done(), "D must wait for a lease that is on its way"
        assert p.node.metrics.registry.get_sample_value("kvsvc_waiting_claims", {"engine": "pend-p"}) == 1
        # A heartbeat from D's queue meanwhile says the lease is not made yet (kept, not lost).
        answers = await heartbeat_published({"late": params}, engine_id="pend-d")
        assert answers == {"late": {f"127.0.0.1:{p.port}": LEASE_NOT_YET_MADE}}
        await _lease(p, "late", 3)
        resp = await asyncio.wait_for(call, 30)
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        assert await asyncio.wait_for(lease_ended(p, "late"), 30) is LeaseState.CONSUMED
        assert seen.claims == 1, "one claim, held on P: D does not ask again"
        assert p.node.leases.arrivals.waiting == 0
        assert d_carriers(p) == {carrier}


def d_carriers(p: RunningServer) -> set[str]:
    """How D's lease calls reached P: "socket" when P's lease socket served a connection."""
    socket = p.lease_socket
    return {"socket" if socket is not None and socket.connections_served else "grpc"}


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
async def test_a_waiting_claim_holds_up_no_other_call_on_its_stream(carrier):
    """P answers the calls behind a waiting claim on the same LeaseChannel as they come; the
    waiting claim's answer follows in a message of its own."""
    async with in_process_pair("pend", **CARRIERS[carrier]) as (p, d), engines(p, d) as (pc, dc, pe, de):
        seen = ClaimsSeen(p)
        pe.fill([[3], [5]])
        late = asyncio.ensure_future(dc.transfer("d-late", _params(p, "late", 3), [[4]]))
        await asyncio.wait_for(seen.waiting.wait(), 30)
        pub = await pc.publish_blocks("now", [[5]])
        await asyncio.wait_for(dc.transfer("d-now", pub.params, [[6]]), 30)
        assert same_block_bytes(pe, 5, de, 6) and not late.done()
        await _lease(p, "late", 3)
        await asyncio.wait_for(late, 30)
        assert same_block_bytes(pe, 3, de, 4)
        assert await asyncio.wait_for(lease_ended(p, "late"), 30) is LeaseState.CONSUMED
        assert p.node.leases.live_count == 0
        assert d_carriers(p) == {carrier}


async def test_waiting_claims_are_bounded_and_one_refused_is_given_up_on_p():
    async with in_process_pair("pend") as (p, d), engines(p, d) as (_pc, dc, pe, de):
        seen = ClaimsSeen(p)
        p.node.leases.arrivals.max_per_engine = 1
        pe.fill([[3]])
        first = asyncio.ensure_future(dc.transfer("d-1", _params(p, "one", 3), [[4]]))
        await asyncio.wait_for(seen.waiting.wait(), 30)
        with pytest.raises(KvsvcError) as e:
            await asyncio.wait_for(dc.transfer("d-2", _params(p, "two", 3), [[5]]), 30)
        assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TOO_MANY_WAITING_CLAIMS"), e.value
        assert e.value.metadata["engine_id"] == "pend-d" and e.value.metadata["max_per_engine"] == "1"
        # D gave "two" up and told P so: the lease, made now, is refused rather than held.
        with pytest.raises(FailedPrecondition) as refusal:
            await _lease(p, "two", 3)
        assert refusal.value.reason == "LEASE_ABORTED"
        await _lease(p, "one", 3)
        await asyncio.wait_for(first, 30)
        assert same_block_bytes(pe, 3, de, 4)
        assert await asyncio.wait_for(lease_ended(p, "one"), 30) is LeaseState.CONSUMED
        assert p.node.leases.live_count == 0 and p.node.leases.arrivals.waiting == 0


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_what_d_gives_up_waiting_for_p_is_told_and_refuses_later(how):
    """D's deadline passes, or its caller cancels, while the claim waits: P's waiter ends
    and the lease, made afterwards, is refused (LEASE_ABORTED), not held to its TTL."""
    async with in_process_pair("pend") as (p, d), engines(p, d) as (_pc, dc, _pe, _de):
        seen = ClaimsSeen(p)
        params = _params(p, "slow", 3)
        call = asyncio.ensure_future(dc.transfer("d-slow", params, [[4]], timeout_s=1.0 if how == "deadline" else None))
        await asyncio.wait_for(seen.waiting.wait(), 30)
        if how == "cancel":
            call.cancel()
        with pytest.raises((KvsvcError, asyncio.CancelledError)) as e:
            await asyncio.wait_for(call, 30)
        if how == "deadline":
            assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata.get("state") == "unknown", e.value
        await asyncio.wait_for(seen.stopped_waiting.wait(), 30)
        assert p.node.leases.arrivals.waiting == 0
        async with AsyncClient(f"127.0.0.1:{d.port}") as watcher:
            await watcher.settled("d-slow")  # D answered for the transfer only once P was told (or tried)
        with pytest.raises(FailedPrecondition) as refusal:
            await _lease(p, "slow", 3)
        assert refusal.value.reason == "LEASE_ABORTED"
        assert p.node.leases.live_count == 0 and seen.claims == 1


async def test_without_lease_pending_an_unknown_lease_fails_at_once():
    async with in_process_pair("pend") as (p, d), engines(p, d) as (_pc, dc, _pe, _de):
        with pytest.raises(FailedPrecondition) as e:
            await asyncio.wait_for(dc.transfer("d-none", _params(p, "none", 3, pending=False), [[4]]), 30)
        assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata.get("state") == "unknown", e.value


@pytest.mark.parametrize("how", ["refused", "aborted first"])
async def test_a_lease_that_will_not_come_fails_the_waiting_d_at_once(how):
    """The engine could not lease the blocks (its server refused; it leaves a tombstone), or
    the router gave the request up before the lease was made (that lease is then refused)."""
    async with in_process_pair("pend") as (p, d), engines(p, d) as (_pc, dc, _pe, _de):
        params = _params(p, "gone", 3)
        seen = ClaimsSeen(p)
        call = asyncio.ensure_future(dc.transfer("d-gone", params, [[4]]))
        await asyncio.wait_for(seen.waiting.wait(), 30)
        assert not call.done()
        if how == "refused":
            p.node.leases.refuse("gone", TOKEN)
        else:
            assert set((await abort_published(params)).values()) == {"LEASE_STATE_UNKNOWN"}
            with pytest.raises(FailedPrecondition) as refusal:
                await _lease(p, "gone", 3)
            assert refusal.value.reason == "LEASE_ABORTED"
            p.node.leases.refuse("gone", TOKEN)  # what the connector's worker does on that refusal
        # Well within the 30 s a pending lease is waited for: the tombstone ends the wait.
        with pytest.raises(FailedPrecondition) as e:
            await asyncio.wait_for(call, 10)
        assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata.get("state") == "aborted", e.value
        assert p.node.leases.live_count == 0 and p.node.leases.leased_blocks == 0
