"""The settlement contract (docs/RELIABILITY.md, "The settlement contract"): one test per
outcome, against real servers and NIXL.

Every transfer ends in exactly one outcome, and the engine learns it in the same words
from the Transfer answer and from WaitTransfer: completed; failed before any READ;
failed or cancelled with READs in flight (answered once they ended: settled); quarantined
(READs that did not end: not settled until they did, and a late completion never turns
the failure into a success); peer unhealthy; not found (fenced). P's side of each is
checked too: the lease ends consumed only for a completed transfer.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.errors import KvsvcError
from kvsvc.leases.table import LeaseState
from kvsvc.service import transfer_run
from kvsvc.service.in_process import InProcessTransfers
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import HeldReads, in_process_pair, lease_ended, same_block_bytes
from tests.e2e.test_read_then_claim import engines


def failure_of(e: KvsvcError) -> pb.TransferFailure:
    (failure,) = [x for x in e.details if isinstance(x, pb.TransferFailure)]
    return failure


def quarantined_gauge(d, what: str = "transfers") -> float:
    return d.node.metrics.registry.get_sample_value(f"kvsvc_quarantined_{what}", {"engine": d.node.config.engine_id})


async def test_completed():
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        pub = await pc.publish_blocks("ok", [[3]])
        resp = await dc.transfer("d-ok", pub.params, [[4]])
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        assert (await dc.wait_transfer("d-ok")).state == pb.TRANSFER_STATE_SUCCEEDED
        assert await asyncio.wait_for(lease_ended(p, "ok"), 30) is LeaseState.CONSUMED


async def test_failed_before_any_read_is_settled_at_once_and_gives_p_its_lease_back():
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, _pe, _de):
        reads = HeldReads(d)
        pub = await pc.publish_blocks("bad", [[3]])
        with pytest.raises(KvsvcError) as e:
            await dc.transfer("d-bad", pub.params, [[10_000]])  # a local block past D's pool
        assert e.value.reason == "BLOCK_OUT_OF_RANGE"
        assert not reads.posted.is_set(), "nothing was read"
        state = await dc.wait_transfer("d-bad")
        assert state.state == pb.TRANSFER_STATE_FAILED and not state.failure.valid_local_block_ids_per_group
        assert p.node.leases.final_state("bad") is LeaseState.ABORTED


@pytest.mark.parametrize("how", ["read failed", "cancelled"])
async def test_failed_or_cancelled_in_flight_is_answered_only_once_its_reads_ended(how, monkeypatch):
    """The claim refused after the READ (the lease aborted meanwhile), or the caller gone:
    the answer (or WaitTransfer's FAILED) comes only after the READ ended; P is told."""
    # The held READ claims nothing while it runs (a claim would win over the router's
    # abort, however slow the machine): it ends only when released below, then claims.
    monkeypatch.setattr(transfer_run, "EARLY_CLAIM_S", 3600.0)
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, _pe, _de):
        reads = HeldReads(d)
        pub = await pc.publish_blocks("mid", [[3]])
        call = asyncio.ensure_future(dc.transfer("d-mid", pub.params, [[4]]))
        await asyncio.wait_for(reads.posted.wait(), 30)
        if how == "cancelled":
            call.cancel()
        else:  # the router gives the request up while D reads: P refuses D's claim
            from kvsvc.client.leases import abort_published
            await abort_published(pub.params, engine_id="router")
            reads.release()
        with pytest.raises((KvsvcError, asyncio.CancelledError)) as e:
            await asyncio.wait_for(call, 30)
        state = await asyncio.wait_for(dc.wait_transfer("d-mid", wait_ms=30_000), 60)
        assert state.state == pb.TRANSFER_STATE_FAILED, state  # settled: no READ of it can write
        if how == "read failed":
            assert e.value.reason == "LEASE_EXPIRED" and not failure_of(e.value).quarantined
        assert p.node.leases.final_state("mid") is LeaseState.ABORTED


async def test_quarantined_until_its_reads_end_and_a_late_completion_stays_a_failure(monkeypatch):
    """A READ that NIXL cannot end (held here, as over a dead link): past QUARANTINE_AFTER_S
    the transfer answers its failure marked quarantined, WaitTransfer says QUARANTINED and
    the gauge counts it. The READ then completes -- successfully, bytes and all: the
    transfer stays FAILED (settled now), a retry of it is answered the failure, and the
    engine was never told the blocks are good."""
    monkeypatch.setattr(transfer_run, "QUARANTINE_AFTER_S", 0.2)  # the bound itself: nothing ends the READ
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, pe, de):
        reads = HeldReads(d, abort=False)
        pe.fill([[3]])
        pub = await pc.publish_blocks("stuck", [[3]])
        # In process (as the vLLM and SGLang integrations call): the answer itself, which a
        # gRPC caller whose deadline is this short would not wait for (it asks WaitTransfer).
        with pytest.raises(KvsvcError) as e:
            await InProcessTransfers(d).transfer("d-stuck", pub.params, [[4]], timeout_s=1.0)
        assert e.value.reason == "DEADLINE_EXCEEDED" and failure_of(e.value).quarantined, e.value
        assert (await dc.wait_transfer("d-stuck", wait_ms=0)).state == pb.TRANSFER_STATE_QUARANTINED
        assert quarantined_gauge(d) == 1 and quarantined_gauge(d, "bytes") == sum(r.block_len for r in de.mem[0].regions)
        reads.release()  # the late completion: the READ lands
        state = await dc.wait_transfer("d-stuck", wait_ms=30_000)
        assert state.state == pb.TRANSFER_STATE_FAILED and not state.failure.quarantined
        assert quarantined_gauge(d) == 0 and quarantined_gauge(d, "bytes") == 0
        assert same_block_bytes(pe, 3, de, 4), "the bytes did land late"
        with pytest.raises(KvsvcError) as again:  # a retry: the same failure, never OK
            await dc.transfer("d-stuck", pub.params, [[4]])
        assert again.value.reason == "DEADLINE_EXCEEDED"
        assert p.node.leases.final_state("stuck") is LeaseState.ABORTED


async def test_peer_unhealthy_is_a_typed_retryable_failure_and_settled():
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, _pe, _de):
        pub = await pc.publish_blocks("gone", [[3]])
        await p.stop(0)
        with pytest.raises(KvsvcError) as e:
            await dc.transfer("d-gone", pub.params, [[4]], timeout_s=10)
        assert (e.value.code.value, e.value.reason) == ("UNAVAILABLE", "PEER_UNAVAILABLE"), e.value
        assert not failure_of(e.value).quarantined
        assert (await dc.wait_transfer("d-gone")).state == pb.TRANSFER_STATE_FAILED


async def test_not_found_is_fenced():
    """An id D never saw: UNKNOWN, and the id is fenced -- a Transfer of it arriving late is
    refused, so the engine may free those blocks on UNKNOWN."""
    async with in_process_pair("st") as (p, d), engines(p, d) as (pc, dc, _pe, _de):
        assert (await dc.wait_transfer("d-never")).state == pb.TRANSFER_STATE_UNKNOWN
        pub = await pc.publish_blocks("late", [[3]])
        with pytest.raises(KvsvcError) as e:
            await dc.transfer("d-never", pub.params, [[4]])
        assert e.value.reason == "TRANSFER_FENCED"
