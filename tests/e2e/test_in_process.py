"""The in-process carrier (kvsvc/service/in_process.py): an engine's transfers to the D
server embedded in its own process, as calls on their shared loop -- with the
TransferStream's guarantees: right bytes, retries joining one job, failures carrying
TransferFailure, a caller that gives up settling before it hears so."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.client import AsyncClient
from kvsvc.client.leases import abort_published
from kvsvc.errors import KvsvcError, PermissionDenied, Unavailable
from kvsvc.leases.table import LeaseState, NotifyKind
from kvsvc.service.in_process import InProcessTransfers
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, HeldReads, in_process_pair, lease_ended, same_block_bytes


async def test_in_process_transfers_move_the_right_bytes_and_join_retries():
    async with in_process_pair("ipc") as (p, d), AsyncClient(f"127.0.0.1:{p.port}") as pc, \
            AsyncClient(f"127.0.0.1:{d.port}") as dc:
        pe, de = await Engine.of(pc), await Engine.of(dc)
        try:
            carrier = InProcessTransfers(d)
            pe.fill([[3, 5]])
            pub = await pc.publish_blocks("ip-1", [[3, 5]])
            first, again = await asyncio.gather(carrier.transfer("d-ip-1", pub.params, [[7, 9]], timeout_s=30),
                                                carrier.transfer("d-ip-1", pub.params, [[7, 9]], timeout_s=30))
            assert first == again and first.total_bytes > 0, "a retry joined the one job"
            assert same_block_bytes(pe, 3, de, 7) and same_block_bytes(pe, 5, de, 9)
            assert await asyncio.wait_for(lease_ended(p, "ip-1"), 30) is LeaseState.CONSUMED  # consumed once
            await carrier.settled("d-ip-1")  # done: returns at once

            bad = await pc.publish_blocks("ip-2", [[4]])
            bad.params.lease_token = "0" * 32
            with pytest.raises(PermissionDenied) as e:
                await carrier.transfer("d-ip-2", bad.params, [[8]], timeout_s=30)
            assert any(isinstance(x, pb.TransferFailure) for x in e.value.details), e.value.details
            await carrier.settled("d-ip-2", e.value)

            await carrier.close()
            with pytest.raises(Unavailable):
                await carrier.transfer("d-ip-3", pub.params, [[1]])
        finally:
            pe.close()
            de.close()


async def test_a_cancelled_in_process_transfer_settles_before_settled_returns():
    """The caller's task cancelled while D reads (its READ held): the job is given up, and
    settled() returns only once the READ ended -- never while it could still write."""
    async with in_process_pair("ipx") as (p, d), AsyncClient(f"127.0.0.1:{p.port}") as pc:
        reads = HeldReads(d, abort=False)  # the READ ends on release only, cancelled or not
        carrier = InProcessTransfers(d)
        pub = await pc.publish_blocks("ip-c", [[2]])
        call = asyncio.ensure_future(carrier.transfer("d-ip-c", pub.params, [[6]], timeout_s=30))
        await asyncio.wait_for(reads.posted.wait(), 30)  # its READ posted and held
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        waiting = asyncio.ensure_future(carrier.settled("d-ip-c", asyncio.CancelledError()))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "settled() returned while the READ could still write"
        reads.release()
        await asyncio.wait_for(waiting, 10)
        job = d.decoder.jobs.find("d-ip-c")
        assert job is None or job.settled.is_set()
        with pytest.raises(KvsvcError):
            await pc.claim_lease(pb.ClaimLeaseRequest(request_id="ip-c"))  # no lease left to claim


async def test_a_refused_transfer_frees_ps_lease_over_the_channel_it_already_has(monkeypatch):
    """A transfer refused before its first READ (params with a wrong DCP size) gives P its
    lease back at once, over the handshaken peer's open channel: no new one is dialled."""
    from kvsvc.client import leases

    async with in_process_pair("ipa") as (p, d), AsyncClient(f"127.0.0.1:{p.port}") as pc:
        carrier = InProcessTransfers(d)
        warm = await pc.publish_blocks("ipa-warm", [[1]])
        await carrier.transfer("d-ipa-warm", warm.params, [[2]], timeout_s=30)  # handshaken: a peer is cached
        dialled: list[str] = []
        real_client = leases.AsyncClient

        def counting(address, *args, **kw):
            dialled.append(address)
            return real_client(address, *args, **kw)

        monkeypatch.setattr(leases, "AsyncClient", counting)
        pub = await pc.publish_blocks("ipa", [[3]])
        pub.params.remote_dcp_size = 2
        with pytest.raises(KvsvcError) as e:
            await carrier.transfer("d-ipa", pub.params, [[4]], timeout_s=30)
        assert e.value.reason == "DCP_MISMATCH"
        for _ in range(200):
            if p.node.leases.live_count == 0:
                break
            await asyncio.sleep(0.01)
        assert p.node.leases.live_count == 0, "P's lease was given back"
        assert dialled == [], dialled


class Heard:
    """An engine's on_release: every release in the order heard, and an event per count."""

    def __init__(self) -> None:
        self.releases: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def __call__(self, request_id: str, how) -> None:
        self.releases.append((request_id, how.value))
        self.changed.set()

    async def until(self, n: int) -> list[tuple[str, str]]:
        while len(self.releases) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 30)
        return self.releases


async def test_in_process_leases_report_each_release_once_in_order_and_repair_a_gap():
    """P's port: leases made in process, every release heard once and in order (withdrawn
    ones not at all); a subscription that fell behind is made again, and each lease made
    here or named by waiting_for that was released in the gap is reported as its tombstone
    says -- a live one is not."""
    from kvsvc.service.in_process import InProcessLeases

    async with in_process_pair("ipl") as (p, _d):
        heard = Heard()
        named = ["external-gone"]  # leased by someone else; the engine waits for it
        leases = InProcessLeases(p, heard, lambda: named)
        token = "7a" * 16

        def lease(rid: str, block: int) -> pb.TransferParams:
            lease_ = leases.lease(pb.PublishBlocksRequest(request_id=rid, lease_token=token,
                                                          block_ids_per_group=[pb.BlockIds(block_ids=[block])]))
            return lease_params(p, rid, lease_.token)

        for i in range(3):
            lease(f"r{i}", i + 1)
        assert leases.withdraw("r1", token) and leases.final_state("r1") == LeaseState.ABORTED
        for rid in ("r2", "r0"):
            await abort_published(lease_params(p, rid, token), engine_id="router")
        assert await heard.until(2) == [("r2", "aborted"), ("r0", "aborted")], "in order, r1 not announced"

        # The loop stalled through 64 MiB of releases: the subscription overflows at the next one.
        lease("live", 5)
        lease("gone", 6)
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc:
            await pc.publish_blocks("external-gone", [[7]])
        for sub in list(p.node.leases._watchers):
            sub._max = 1
        await abort_published(lease_params(p, "gone", token), engine_id="router")
        leases_table = p.node.leases
        leases_table.notify("external-gone", NotifyKind.ABORTED, [], leases.epoch,
                            token=leases_table.get("external-gone").token)
        released = await heard.until(4)
        assert sorted(released[2:]) == [("external-gone", "aborted"), ("gone", "aborted")]
        assert leases.gap_repairs == 1 and leases.is_live("live")
        # The new subscription hears what comes after, once.
        await abort_published(lease_params(p, "live", token), engine_id="router")
        assert (await heard.until(5))[4] == ("live", "aborted")
        await asyncio.sleep(0)
        assert len(heard.releases) == 5
        await leases.close()


def lease_params(p, rid: str, token: str) -> pb.TransferParams:
    """Params naming p's lease of rid (what abort_published needs: address, epoch, token)."""
    return pb.TransferParams(remote_address=f"127.0.0.1:{p.port}", remote_engine_id=p.node.config.engine_id,
                             remote_request_id=rid, remote_epoch=p.node.epoch, lease_token=token)
