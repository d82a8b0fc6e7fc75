"""A granted claim is the proof: D answers before P confirms (docs/RELIABILITY.md, promise 1),
against real servers and NIXL in this process.

A READ still running after EARLY_CLAIM_S claims the lease while it runs. Once the READs
ended, D answers at once when its own clock proves every P server still holds that claim
(LeaseClock.held_until: counted from when the claim or last heartbeat was sent), and the
CONSUMED follows the answer; otherwise it waits for P's confirm as before. A progressive
lease is never read that way: P refuses an early claim that reads one whole.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvsvc.errors import InvalidArgument, Unavailable
from kvsvc.leases.table import LeaseState, NotifyKind
from kvsvc.reasons import Reason
from kvsvc.service import legs, transfer_run
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import in_process_pair, lease_ended, same_block_bytes
from tests.e2e.test_read_then_claim import engines, held_past_early_claim

pytestmark = pytest.mark.timeout(120)


class HeldConfirms:
    """Holds D's CONSUMED reports of early claims (transfer_run.confirm_all) until opened:
    `entered` is set once one waits. fail: raise this instead of confirming, once opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: Exception | None = None) -> None:
        self.entered, self.opened = asyncio.Event(), asyncio.Event()
        real: Callable[..., Awaitable[None]] = transfer_run.confirm_all

        async def held(*args: Any, **kw: Any) -> None:
            self.entered.set()
            await self.opened.wait()
            if fail is not None:
                raise fail
            await real(*args, **kw)

        monkeypatch.setattr(transfer_run, "confirm_all", held)

    def open(self) -> None:
        self.opened.set()


async def test_a_held_claim_answers_before_p_confirms_and_p_frees_the_blocks_after(monkeypatch):
    async with in_process_pair("caa") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        confirms = HeldConfirms(monkeypatch)
        _pub, call, reads = await held_past_early_claim(p, d, pc, dc, "early")
        reads.release()
        resp = await asyncio.wait_for(call, 30)  # answered while P's confirm is held
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        await asyncio.wait_for(confirms.entered.wait(), 30)
        lease = p.node.leases.get("early")
        assert lease is not None and lease.state is LeaseState.CLAIMED, "P heard nothing yet: the claim still holds"
        confirms.open()
        assert await asyncio.wait_for(lease_ended(p, "early"), 30) is LeaseState.CONSUMED


async def test_without_that_proof_d_waits_for_p(monkeypatch):
    """D's clock cannot prove the claim held to the READs' end (here: a margin longer than
    any lease): the transfer answers only once P confirmed, and P's lease is consumed then."""
    monkeypatch.setattr(legs, "HELD_MARGIN_S", 3600.0)
    async with in_process_pair("caa") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        confirms = HeldConfirms(monkeypatch)
        _pub, call, reads = await held_past_early_claim(p, d, pc, dc, "waits")
        reads.release()
        await asyncio.wait_for(confirms.entered.wait(), 30)
        assert not call.done(), "answered before P confirmed, without proof that P held the lease"
        confirms.open()
        resp = await asyncio.wait_for(call, 30)
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        assert p.node.leases.final_state("waits") is LeaseState.CONSUMED


async def test_a_confirm_p_never_takes_leaves_the_transfer_good_and_the_lease_to_its_ttl(monkeypatch, caplog):
    async with in_process_pair("caa") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        confirms = HeldConfirms(monkeypatch, fail=Unavailable(Reason.PEER_UNAVAILABLE, "injected: P is gone"))
        _pub, call, reads = await held_past_early_claim(p, d, pc, dc, "lost")
        reads.release()
        resp = await asyncio.wait_for(call, 30)
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        (late,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "TransferRun._confirm_after_answer"]
        with caplog.at_level(logging.WARNING, logger="kvsvc.service.transfer_run"):
            confirms.open()
            await asyncio.wait_for(late, 30)  # ends without raising: the transfer's answer stands
        assert any("its lease ends at its TTL" in r.getMessage() for r in caplog.records)
        lease = p.node.leases.get("lost")
        assert lease is not None and lease.state is LeaseState.CLAIMED  # freed when its TTL runs out
        # (ended here by its claimant, as D would on its next word: a stopping P holds a
        # claimed lease to its deadline)
        p.node.leases.notify("lost", NotifyKind.ABORTED, [], p.node.epoch, claim_id=next(iter(lease.claims)))


async def test_p_refuses_an_early_claim_that_reads_a_progressive_lease_whole():
    """Params with `progressive` cleared (a router that rewrote them): D reads the lease
    whole and claims early with the blocks' digest; P refuses, so D never takes its claim
    for proof of blocks the engine may withdraw."""
    async with in_process_pair("caa") as (p, d), engines(p, d) as (pc, _dc, _pe, _de):
        opened = pb.PublishBlocksRequest(request_id="grow", block_ids_per_group=[pb.BlockIds(block_ids=[3])],
                                         num_tokens=4, progressive=True)
        params = (await pc.publish_blocks_request(opened)).params
        claim = pb.ClaimLeaseRequest(request_id="grow", lease_epoch=params.remote_epoch, engine_id="caa-d", tp_size=1,
                                     lease_token=params.lease_token, claim_id=secrets.token_hex(16),
                                     blocks_digest=b"\x01" * 32)
        with pytest.raises(InvalidArgument) as e:
            await pc.claim_lease(claim)
        assert e.value.reason == "PARAMS_INCONSISTENT" and e.value.metadata.get("progressive") == "true", e.value
        lease = p.node.leases.get("grow")
        assert lease is not None and not lease.claims, "a refused claim holds nothing"
        claim.blocks_digest = b""  # the claim a progressive D makes is granted
        await pc.claim_lease(claim)
        assert p.node.leases.get("grow").claims
        # D gives its claim up: the lease ends now (not held by P's shutdown drain)
        await pc.notify(pb.NotifyRequest(request_id="grow", kind=pb.NOTIFY_KIND_ABORTED, engine_id="caa-d", tp_size=1,
                                         lease_epoch=params.remote_epoch, claim_id=claim.claim_id))
        assert await lease_ended(p, "grow") is LeaseState.ABORTED
