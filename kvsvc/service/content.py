"""Content digests on the server: P takes them when a lease is made, D checks what landed.

Turned on by content_digest on both servers (off by default: on two cores here a digest
costs more than the READ it checks; benchmarks/content_digest.py measures it). P hashes a
lease's blocks on a worker thread as the lease is made (PublishBlocks answers once they are
hashed; an engine embedding the server does not wait for them) and answers a claim that
asks (ClaimLeaseRequest.want_content) with them. D hashes what its READs landed on a worker
thread while it confirms, and fails the transfer with DIGEST_MISMATCH (DATA_LOSS) where the
two differ: the engine never serves those bytes. Blocks in GPU memory are not digested.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np

from kvsvc.errors import DataLoss
from kvsvc.layout.regions import Region
from kvsvc.leases.records import Lease
from kvsvc.memory.content import block_digests, landed_digests
from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service.node import Node
from kvsvc.service.peers import RemoteRank
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


# ---- P ---------------------------------------------------------------------------------

def take(node: Node, lease: Lease, *, now: bool = False) -> None:
    """Start hashing the lease's blocks (on the loop: the work runs on a worker thread; now:
    here, before this returns -- an injected fault that rewrites the blocks right after)."""
    ranks = [r for r in node.hosted_ranks if node.pools[r].memory_kind is MemoryKind.DRAM]
    if not node.config.content_digest or not ranks:
        return
    regions = node.side.pool.regions
    blocks = [ids.tolist() for ids in lease.block_ids]

    def digests() -> list[pb.BlockContent]:
        return [pb.BlockContent(rank=r, groups=[pb.GroupContent(digests=d) for d in block_digests(
            regions, node.pools[r].region_address, blocks)]) for r in ranks]

    loop = asyncio.get_running_loop()
    if now:
        lease.content = loop.create_future()
        lease.content.set_result(digests())
    else:
        lease.content = loop.run_in_executor(None, digests)


async def answer(lease: Lease | None, resp: pb.ClaimLeaseResponse, *, req: pb.ClaimLeaseRequest) -> pb.ClaimLeaseResponse:
    """resp with the digests of every rank this server hosts, where D asked and they were
    taken (D's claim names D's ranks, not which of ours they read)."""
    if lease is None or lease.content is None or not req.want_content:
        return resp
    resp.content.extend(await asyncio.shield(lease.content))
    return resp


# ---- D ---------------------------------------------------------------------------------

Reads = list[tuple[int, tuple[RemoteRank, np.ndarray, np.ndarray, np.ndarray]]]


def landed(node: Node, p_regions: Sequence[Region], reads: Reads) -> dict[int, tuple[dict[tuple[int, int], int], int]]:
    """Per P rank: the digests of the P blocks the READs landed whole, and how many others
    they touched (on a worker thread: it reads every landed byte)."""
    by_rank: dict[int, tuple[RemoteRank, list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {}
    for t, (rr, la, ra, ln) in reads:
        if rr.memory_kind is not MemoryKind.DRAM or node.pools[t].memory_kind is not MemoryKind.DRAM:
            continue
        _, ls, rs, ns = by_rank.setdefault(rr.rank, (rr, [], [], []))
        ls.append(la)
        rs.append(ra)
        ns.append(ln)
    return {rank: landed_digests(p_regions, rr.bases, np.concatenate(ls), np.concatenate(rs), np.concatenate(ns))
            for rank, (rr, ls, rs, ns) in by_rank.items()}


def check(request_id: str, remote_ids: list[list[int]], sent: Sequence[pb.BlockContent],
          got: dict[int, tuple[dict[tuple[int, int], int], int]]) -> tuple[int, int]:
    """Compare what landed with what P sent; (blocks checked, blocks not checked). Raises
    DataLoss (DIGEST_MISMATCH) naming the first block that differs."""
    expected: dict[int, dict[tuple[int, int], int]] = {}
    for c in sent:
        expected[c.rank] = {(g, b): d for g, gc in enumerate(c.groups)
                            for b, d in zip(remote_ids[g] if g < len(remote_ids) else [], gc.digests, strict=False)}
    checked = unchecked = 0
    for rank, (digests, partial) in got.items():
        unchecked += partial
        mine = expected.get(rank)
        if mine is None:
            unchecked += len(digests)
            continue
        for (g, b), d in digests.items():
            want = mine.get((g, b))
            if want is None:
                unchecked += 1
            elif want != d:
                raise DataLoss(Reason.DIGEST_MISMATCH, f"block {b} of group {g} from prefill rank {rank} landed with "
                               f"other bytes than the prefill server leased (content digest {d:016x}, leased "
                               f"{want:016x}); the transfer failed and its blocks are invalid",
                               {"request_id": request_id, "rank": rank, "group": g, "block": b})
            else:
                checked += 1
    return checked, unchecked
