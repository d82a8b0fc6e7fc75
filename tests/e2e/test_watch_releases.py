"""WatchReleases against a real server: bounded for a subscriber that stops reading, and
the blocks a release frees when two live leases share some."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvsvc.client import AsyncClient
from kvsvc.client.client import ReleaseStream
from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1.kv_transfer_pb2_grpc import KvTransferServiceStub
from tests.e2e.harness import in_process_pair, layout_table

LAYOUT = layout_table(nb=512)


async def _publish_and_abort(pc: AsyncClient, rid: str, ids: list[int]) -> None:
    pub = await pc.publish_blocks(rid, [ids])
    await pc.notify(pb.NotifyRequest(request_id=rid, kind=pb.NOTIFY_KIND_ABORTED, lease_token=pub.params.lease_token,
                                     lease_epoch=pub.params.remote_epoch, engine_id="router"))


async def test_a_subscriber_that_stops_reading_is_ended_with_a_reason_and_can_resubscribe():
    """Round three, 3: P held every release for a subscriber that stopped reading (18 KiB
    each); now past the backlog bound it is ended with RESOURCE_EXHAUSTED / WATCH_BEHIND,
    what it held is freed, and a new subscription goes on."""
    async with in_process_pair("wb", layout_table=LAYOUT) as (p, _):
        p.node.leases.watch_backlog_bytes = 256 * 1024
        address = f"127.0.0.1:{p.port}"
        # A subscriber's own channel, its HTTP/2 window kept at 64 KiB (no BDP probing): what
        # gRPC buffers for a reader that does not read stays small, the rest waits in kvsvc.
        async with AsyncClient(address) as pc, grpc.aio.insecure_channel(
                address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            stalled = ReleaseStream(KvTransferServiceStub(channel).WatchReleases(pb.WatchReleasesRequest()))
            await stalled._call.initial_metadata()  # subscribed; never read while releases come
            for i in range(300):  # ~2.5 KiB of backlog each: ~750 KiB, past the bound and the window
                await _publish_and_abort(pc, f"r{i}", list(range(256)))
            assert all(sub.held_bytes <= 256 * 1024 for sub in p.node.leases._watchers)
            assert not p.node.leases._watchers, "the stalled subscriber was ended"
            read = 0
            with pytest.raises(KvsvcError) as e:
                async for _ in stalled:
                    read += 1  # what gRPC had buffered before the end
            assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "WATCH_BEHIND")
            assert "ListLeases" in e.value.message and read < 300
            again = await pc.open_release_stream()
            await _publish_and_abort(pc, "after", [1])
            ev = await asyncio.wait_for(anext(aiter(again)), 10)
            assert ev.request_id == "after" and list(ev.free_block_ids_per_group[0].block_ids) == [1]
            again.cancel()


async def test_a_release_frees_only_the_blocks_no_other_live_lease_holds():
    """Round three, 12: the same block in two live leases; the first release does not list
    it as free, the last one does."""
    async with in_process_pair("share", layout_table=LAYOUT) as (p, _):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc:
            stream = await pc.open_release_stream()
            events = aiter(stream)
            a = await pc.publish_blocks("a", [[1, 2, 3]])
            b = await pc.publish_blocks("b", [[3, 4]])
            for pub in (a, b):
                await pc.notify(pb.NotifyRequest(request_id=pub.params.remote_request_id, kind=pb.NOTIFY_KIND_ABORTED,
                                                 lease_token=pub.params.lease_token,
                                                 lease_epoch=pub.params.remote_epoch, engine_id="router"))
            first, last = [await asyncio.wait_for(anext(events), 10) for _ in range(2)]
            assert list(first.block_ids_per_group[0].block_ids) == [1, 2, 3]
            assert list(first.free_block_ids_per_group[0].block_ids) == [1, 2]
            assert list(last.free_block_ids_per_group[0].block_ids) == [3, 4]
            stream.cancel()
