"""A minimal prefill engine, router and decode engine around kvsvc: the template an engine author copies.

    python clients/python/examples/pd_engines.py --prefill HOST:PORT --decode HOST:PORT --requests 4

Each engine talks only to its own local kvsvc server, over gRPC:
- the prefill engine maps its server's KV pools (GetInfo + attach), "computes" a
  request's KV into free blocks, publishes them, and returns blocks to its free list
  when WatchReleases says they are released;
- the router hands the TransferParams from prefill to decode, untouched;
- the decode engine allocates local blocks, calls Transfer, and reads its pool.
The "model" here is kvsvc.verify: it writes known KV on prefill and checks it on decode.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvsvc.client import AsyncClient
from kvsvc.client.attach import attach_pool
from kvsvc.client.leases import abort_published
from kvsvc.codec import layout_from_proto
from kvsvc.errors import KvsvcError
from kvsvc.layout.regions import build_pool_layout
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.verify import RankMemory, check_rank, fill_rank


class BlockAllocator:
    """The engine's own free list (one list for every group here, for brevity)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        """n free blocks, waiting for releases when there are too few."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.free) >= n)
            out, self.free = self.free[:n], self.free[n:]
            return out

    async def give_back(self, ids: list[int]) -> None:
        async with self._changed:
            self.free.extend(ids)
            self._changed.notify_all()


class Engine:
    """What both engines share: the local server, its layout and its mapped pools."""

    def __init__(self, address: str) -> None:
        self.client = AsyncClient(address)
        self.info: pb.GetInfoResponse | None = None

    async def start(self) -> None:
        self.info = await self.client.get_info()
        self.layout = layout_from_proto(self.info.layout, tp_size=self.info.tp_size)
        regions = build_pool_layout(self.layout).regions
        self.pools = {p.tp_rank: RankMemory(regions, attach_pool(p).buffer) for p in self.info.pools}
        self.blocks = BlockAllocator(self.layout.num_blocks)

    def groups(self, ids: list[int]) -> list[list[int]]:
        return [ids for _ in self.layout.groups]

    async def close(self) -> None:
        await self.client.close()


class PrefillEngine(Engine):
    async def prefill(self, request_id: str, num_blocks: int) -> pb.TransferParams:
        """Run the "model" over a prompt into fresh blocks on every rank, then publish them."""
        assert self.info is not None
        ids = self.groups(await self.blocks.take(num_blocks))
        for rank, mem in self.pools.items():
            fill_rank(mem, rank, self.info.tp_size, self.layout.total_num_kv_heads, ids, self.layout.block_size)
        return (await self.client.publish_blocks(request_id, ids)).params

    async def start(self) -> None:
        await super().start()
        # Subscribe before the first publish, so that no release can be missed.
        self.releases = await self.client.open_release_stream()

    async def recycle_released_blocks(self, stop: asyncio.Event) -> None:
        """The other half of the lease: blocks come back only when kvsvc says so."""
        async for ev in self.releases:
            # free_block_ids_per_group, not block_ids_per_group: a block another live lease
            # still holds (a shared prefix) comes back with that lease's release.
            await self.blocks.give_back(list(ev.free_block_ids_per_group[0].block_ids))
            print(f"  prefill: {ev.request_id} released ({pb.ReleaseReason.Name(ev.reason)}), "
                  f"{len(self.blocks.free)} blocks free")
            if stop.is_set():
                return


class DecodeEngine(Engine):
    async def receive(self, request_id: str, params: pb.TransferParams) -> list[list[int]]:
        n = len(params.remote_block_ids_per_group[0].block_ids)
        ids = self.groups(await self.blocks.take(n))
        try:
            result = await self.client.transfer(request_id, params, ids, timeout_s=30)
        except BaseException as e:
            # The blocks hold nothing usable, but they may be reused only once nothing writes
            # into them: settled() asks the server unless the error already says so.
            state = await asyncio.shield(self.client.settled(request_id, e))
            if state is not None and state.state == pb.TRANSFER_STATE_UNKNOWN:
                # The Transfer never reached the server, so nobody claimed P's lease: give it back.
                await asyncio.shield(abort_published(params, engine_id="decode-engine"))
            await self.blocks.give_back(ids[0])
            if isinstance(e, KvsvcError):  # re-prefill or fail the request
                raise RuntimeError(f"{request_id}: transfer failed with {e.reason}") from e
            raise
        print(f"  decode: {request_id} got {result.total_bytes} bytes in {result.duration_us} us")
        return ids

    def kv_is_right(self, ids: list[list[int]]) -> bool:
        assert self.info is not None
        return all(not check_rank(mem, rank, self.info.tp_size, self.layout.total_num_kv_heads, ids,
                                  self.layout.block_size) for rank, mem in self.pools.items())


def route(params: pb.TransferParams) -> pb.TransferParams:
    """A router forwards TransferParams from P to the D it picked; it needs nothing else."""
    return params


async def main(args: argparse.Namespace) -> int:
    prefill, decode = PrefillEngine(args.prefill), DecodeEngine(args.decode)
    await prefill.start()
    await decode.start()
    stop = asyncio.Event()
    recycler = asyncio.ensure_future(prefill.recycle_released_blocks(stop))
    ok = True
    try:
        for i in range(args.requests):
            rid = f"req-{i}"
            params = await prefill.prefill(rid, args.blocks)
            ids = await decode.receive(rid, route(params))
            ok &= decode.kv_is_right(ids)
            await decode.blocks.give_back(ids[0])  # decoding done
        stop.set()
        await asyncio.sleep(0.2)
    finally:
        recycler.cancel()
        prefill.releases.cancel()
        await prefill.close()
        await decode.close()
    print(f"{args.requests} requests moved, KV {'verified' if ok else 'WRONG'}; "
          f"prefill has {len(prefill.blocks.free)} of {prefill.layout.num_blocks} blocks free")
    return 0 if ok and len(prefill.blocks.free) == prefill.layout.num_blocks else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="address of the prefill node's kvsvc server")
    ap.add_argument("--decode", required=True, help="address of the decode node's kvsvc server")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per request")
    sys.exit(asyncio.run(main(ap.parse_args())))
