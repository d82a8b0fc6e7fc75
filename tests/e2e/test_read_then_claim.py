"""Read first, claim after (docs/RELIABILITY.md, promise 1), against real servers and NIXL.

D posts a short transfer's READs before it claims the lease, then claims and reports it
consumed in one message. The races that must never end in wrong bytes reported good:
the lease is aborted (or expires) while the READ is in flight and P's engine writes new
data into the freed blocks; and the two readers of one lease. A READ held past
EARLY_CLAIM_S claims first, and then an abort by the token is refused instead.

The servers run in this process so that the test can hold D's READ at a gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvsvc.client import AsyncClient
from kvsvc.client.leases import abort_published
from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.leases.records import LeaseState
from kvsvc.service.server import RunningServer
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import ClaimsSeen, Engine, HeldReads, in_process_pair, lease_ended, same_block_bytes


class Gate:
    """Holds every READ the D server posts, before it is posted, until opened; .held is set
    once one waits."""

    def __init__(self, d: RunningServer) -> None:
        self.open_ = asyncio.Event()
        self.held = asyncio.Event()
        data = d.node.data
        assert data is not None
        real = data.read

        async def read(*args: Any, **kw: Any) -> Any:
            self.held.set()
            await self.open_.wait()
            return await real(*args, **kw)

        data.read = read  # type: ignore[method-assign]
        data.read_now = lambda *args, **kw: None  # type: ignore[method-assign]  # every READ through the gate

    def open(self) -> None:
        self.open_.set()


@contextlib.asynccontextmanager
async def engines(p: RunningServer, d: RunningServer) -> AsyncIterator[tuple[AsyncClient, AsyncClient, Engine, Engine]]:
    """Clients and mapped pools of both servers, after one transfer (handshake and UCX
    wire-up out of the way)."""
    async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
        pe, de = await Engine.of(pc), await Engine.of(dc)
        try:
            warm = await pc.publish_blocks("warm", [[1]])
            await dc.transfer("d-warm", warm.params, [[2]])
            yield pc, dc, pe, de
        finally:
            pe.close()
            de.close()


async def held_past_early_claim(p: RunningServer, d: RunningServer, pc: AsyncClient, dc: AsyncClient, request_id: str,
                                ) -> tuple[pb.PublishBlocksResponse, asyncio.Future[pb.TransferResponse], HeldReads]:
    """Publish P's block 3 as request_id and start D's transfer of it into block 4, its READ
    held (HeldReads) until P granted the early claim: returned once it did (events, not time)."""
    pub = await pc.publish_blocks(request_id, [[3]])
    reads, claims = HeldReads(d), ClaimsSeen(p)
    call = asyncio.ensure_future(dc.transfer(f"d-{request_id}", pub.params, [[4]]))
    await asyncio.wait_for(claims.granted(request_id).wait(), 30)
    return pub, call, reads


async def test_a_lease_released_while_d_reads_fails_the_transfer_and_never_passes_new_bytes():
    async with in_process_pair("rtc") as (p, d), engines(p, d) as (pc, dc, pe, _de):
        pe.fill([[3]])
        for how in ("aborted", "expired"):
            gate = Gate(d)
            pub = await pc.publish_blocks(f"victim-{how}", [[3]], lease_ttl_ms=300 if how == "expired" else 0)
            call = asyncio.ensure_future(dc.transfer(f"d-{how}", pub.params, [[4]]))
            await asyncio.wait_for(gate.held.wait(), 10)
            if how == "aborted":  # the router gives up on the request: with its token, that is allowed
                assert await abort_published(pub.params) == {f"127.0.0.1:{p.port}": "LEASE_STATE_ABORTED"}
            else:
                await asyncio.sleep(0.5)
                p.node.leases.expire_due()
            pe.fill([[5]])
            for rank_mem in pe.mem.values():  # P's engine reuses the freed block 3 for block 5's data
                for region in rank_mem.regions:
                    src = region.pool_offset + 5 * region.block_stride
                    dst = region.pool_offset + 3 * region.block_stride
                    rank_mem.buf[dst:dst + region.block_len] = rank_mem.buf[src:src + region.block_len]
            gate.open()
            with pytest.raises(FailedPrecondition) as e:
                await call
            assert e.value.reason == "LEASE_EXPIRED", e.value
            failure = [x for x in e.value.details if isinstance(x, pb.TransferFailure)]
            assert failure and not failure[0].valid_local_block_ids_per_group
            pe.fill([[3]])
        assert p.node.leases.live_count == 0 and p.node.leases.claimed_count == 0


async def test_a_read_held_past_the_early_claim_owns_the_lease_and_its_bytes():
    """The rule, not the race: a READ that has not completed when EARLY_CLAIM_S passes claims
    the lease while it runs. Its completion is held until P granted that claim (an event,
    not a clock), so the early claim is certain however fast the machine."""
    async with in_process_pair("rtc") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        pub, call, reads = await held_past_early_claim(p, d, pc, dc, "long")
        assert not call.done(), "the transfer answered before its READ completed"
        assert await abort_published(pub.params) == {f"127.0.0.1:{p.port}": "LEASE_NOT_OWNER"}
        reads.release()
        resp = await call
        assert resp.total_bytes > 0
        assert same_block_bytes(pe, 3, de, 4)
        assert await asyncio.wait_for(lease_ended(p, "long"), 30) is LeaseState.CONSUMED


async def test_two_readers_of_one_lease_one_wins_and_the_other_is_refused():
    async with in_process_pair("rtc") as (p, d), engines(p, d) as (pc, dc, pe, _de):
        for i in range(20):
            pe.fill([[3]])
            pub = await pc.publish_blocks(f"dup{i}", [[3]])
            out = await asyncio.gather(dc.transfer(f"a{i}", pub.params, [[4]]),
                                       dc.transfer(f"b{i}", pub.params, [[5]]), return_exceptions=True)
            ok = [r for r in out if isinstance(r, pb.TransferResponse)]
            refused = [r for r in out if isinstance(r, FailedPrecondition)]
            assert len(ok) == 1 and len(refused) == 1, out
            assert refused[0].reason in ("LEASE_CLAIMED", "LEASE_EXPIRED"), refused[0]
            assert await asyncio.wait_for(lease_ended(p, f"dup{i}"), 30) is LeaseState.CONSUMED
        assert p.node.leases.live_count == 0


async def test_params_stitched_from_two_publishes_are_refused_not_read_as_good():
    """Request a's token with request b's blocks: b's bytes must not pass as a's (b's lease
    may be gone and its blocks reused); a stays leased for its real params."""
    async with in_process_pair("rtc") as (p, d), engines(p, d) as (pc, dc, pe, de):
        pe.fill([[3]])
        a = await pc.publish_blocks("a", [[3]])
        b = await pc.publish_blocks("b", [[6]])
        stitched = pb.TransferParams()
        stitched.CopyFrom(a.params)
        stitched.ClearField("remote_block_ids_per_group")
        stitched.remote_block_ids_per_group.extend(b.params.remote_block_ids_per_group)
        with pytest.raises(InvalidArgument) as e:
            await dc.transfer("d-stitched", stitched, [[4]])
        assert e.value.reason == "PARAMS_INCONSISTENT", e.value
        failure = [x for x in e.value.details if isinstance(x, pb.TransferFailure)]
        assert failure and not failure[0].valid_local_block_ids_per_group
        lease = p.node.leases.get("a")
        assert lease is not None and not lease.claims, "a refused claim holds nothing"
        await dc.transfer("d-a", a.params, [[4]])
        assert same_block_bytes(pe, 3, de, 4)
