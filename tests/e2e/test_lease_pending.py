"""Params handed out before the lease exists (lease_pending), against real servers and NIXL.

An engine may mint the lease token and the params where its requests finish and lease the
blocks on its servers a moment later (the vLLM connector does: no network call on vLLM's
engine thread). A D that arrives first waits for the lease within its deadline; a lease the
engine could not make, or one given up before it was made, fails D at once; params without
lease_pending keep failing at once (the control).
"""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.client.leases import LEASE_NOT_YET_MADE, abort_published, heartbeat_published
from kvsvc.errors import FailedPrecondition
from kvsvc.service import prefill
from kvsvc.service.server import RunningServer
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import in_process_pair, same_block_bytes
from tests.e2e.test_read_then_claim import engines

TOKEN = "5e" * 16


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


async def test_a_d_that_arrives_before_the_lease_waits_for_it_and_reads_the_right_bytes():
    async with in_process_pair("pend") as (p, d), engines(p, d) as (_pc, dc, pe, de):
        pe.fill([[3]])
        params = _params(p, "late", 3)
        call = asyncio.ensure_future(dc.transfer("d-late", params, [[4]]))
        await asyncio.sleep(0.5)  # D has read and asked for the lease, more than once
        assert not call.done(), "D must wait for a lease that is on its way"
        # A heartbeat from D's queue meanwhile says the lease is not made yet (kept, not lost).
        answers = await heartbeat_published({"late": params}, engine_id="pend-d")
        assert answers == {"late": {f"127.0.0.1:{p.port}": LEASE_NOT_YET_MADE}}
        await _lease(p, "late", 3)
        resp = await asyncio.wait_for(call, 30)
        assert resp.total_bytes > 0 and same_block_bytes(pe, 3, de, 4)
        assert p.node.leases.live_count == 0, "consumed at once"


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
        call = asyncio.ensure_future(dc.transfer("d-gone", params, [[4]]))
        await asyncio.sleep(0.3)
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
