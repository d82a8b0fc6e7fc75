"""Content digests on the server: P takes them when a lease is made, D checks what landed.

Turned on by content_digest on both servers (off by default: on two cores here a digest
costs more than the READ it checks; benchmarks/content_digest.py measures it). P hashes a
lease's blocks on a worker thread as the lease is made (PublishBlocks answers once they are
hashed; an engine embedding the server does not wait for them) and answers a claim that
asks (ClaimLeaseRequest.want_content) with them. A progressive lease's blocks are hashed as
commits make them whole (mapping/progressive.whole_blocks: a block the committed tokens
fill, every block at the final commit -- a block committed half-filled, or in only some of
its layers, is still being written), one batch per commit epoch, and WaitCommit answers a D that asks with the batches
since the epoch it has. D hashes what its READs landed on a worker thread while it
confirms, and fails the transfer with DIGEST_MISMATCH (DATA_LOSS) where the two differ: the
engine never serves those bytes. Blocks in GPU memory are not digested.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.errors import DataLoss
from kvsvc.layout.regions import Region
from kvsvc.leases.records import Lease
from kvsvc.mapping.progressive import whole_blocks
from kvsvc.memory.content import block_digests, landed_digests
from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service.commit_follower import group_shapes
from kvsvc.service.node import Node
from kvsvc.service.peers import RemoteRank
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


# ---- P ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Settled:
    """One commit epoch of a progressive lease: per group, the positions in the lease's
    block list [start, end) it made whole, and their digests as they are taken."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    digests: asyncio.Future[list[pb.BlockContent]]


def _digested_ranks(node: Node) -> list[int]:
    if not node.config.content_digest:
        return []
    return [r for r in node.hosted_ranks if node.pools[r].memory_kind is MemoryKind.DRAM]


def _hashing(node: Node, ranks: list[int], blocks: list[list[int]], *,
             now: bool) -> asyncio.Future[list[pb.BlockContent]]:
    """The digests of blocks (per group) on every rank, on a worker thread (now: here, before
    this returns -- an injected fault rewrites them right after)."""
    regions = node.side.pool.regions

    def digests() -> list[pb.BlockContent]:
        return [pb.BlockContent(rank=r, groups=[pb.GroupContent(digests=d) for d in block_digests(
            regions, node.pools[r].region_address, blocks)]) for r in ranks]

    loop = asyncio.get_running_loop()
    if not now:
        return loop.run_in_executor(None, digests)
    done: asyncio.Future[list[pb.BlockContent]] = loop.create_future()
    done.set_result(digests())
    return done


def take(node: Node, lease: Lease, *, now: bool = False) -> None:
    """Start hashing a lease's blocks: a lease made whole, all of them; a progressive one,
    those its latest commit made whole (call after each new commit, and at its opening)."""
    ranks = _digested_ranks(node)
    if not ranks:
        return
    if lease.commits is None:
        lease.content = _hashing(node, ranks, [ids.tolist() for ids in lease.block_ids], now=now)
        return
    settled: list[Settled] = lease.content if lease.content is not None else []
    lease.content = settled
    if len(settled) >= lease.commits.epoch:
        return  # a retried commit: its blocks were taken with it
    commits = lease.commits
    start = settled[-1].end if settled else (0,) * len(lease.block_ids)
    # A chunk committed layer by layer is still being written: only what is whole counts.
    partial = commits.partial if commits.layers_done else (0,) * len(lease.block_ids)
    end = tuple(max(s, whole_blocks(shape, int(ids.size) - part, num_tokens=commits.whole_tokens,
                                    block_size=node.layout.block_size, final=commits.final))
                for s, shape, ids, part in zip(start, group_shapes(node.layout), lease.block_ids, partial,
                                               strict=True))
    blocks = [ids[s:e].tolist() for ids, s, e in zip(lease.block_ids, start, end, strict=True)]
    settled.append(Settled(start, end, _hashing(node, ranks, blocks, now=now)))


def pending(lease: Lease | None) -> asyncio.Future[list[pb.BlockContent]] | None:
    """The digests last started for the lease (a progressive lease's: its latest commit's),
    for a caller that answers once they are taken; None if none were."""
    if lease is None or lease.content is None:
        return None
    if isinstance(lease.content, list):
        return lease.content[-1].digests if lease.content else None
    return lease.content  # type: ignore[no-any-return]


def newly_whole(lease: Lease) -> list[int] | None:
    """The group-0 block ids the progressive lease's latest commit made whole and had hashed
    (None: no digests taken)."""
    if not isinstance(lease.content, list) or not lease.content:
        return None
    last = lease.content[-1]
    return lease.block_ids[0][last.start[0]:last.end[0]].tolist()


async def answer(lease: Lease | None, resp: pb.ClaimLeaseResponse, *, req: pb.ClaimLeaseRequest) -> pb.ClaimLeaseResponse:
    """resp with the digests of every rank this server hosts, where D asked and they were
    taken (D's claim names D's ranks, not which of ours they read). A progressive lease's
    travel with its commits (since())."""
    if lease is None or not isinstance(lease.content, asyncio.Future) or not req.want_content:
        return resp
    resp.content.extend(await asyncio.shield(lease.content))
    return resp


async def since(lease: Lease, after_epoch: int, epoch: int) -> list[pb.BlockContent]:
    """A progressive lease's digests of the blocks commit epochs after_epoch+1 .. epoch made
    whole, per rank: each group's from the first position they hold (GroupContent.first_block)."""
    if not isinstance(lease.content, list):
        return []
    batches = lease.content[after_epoch:epoch]
    if not batches:
        return []
    taken = [await asyncio.shield(b.digests) for b in batches]
    out = []
    for per_rank in zip(*taken, strict=True):
        groups = [pb.GroupContent(first_block=first, digests=[d for c in per_rank for d in c.groups[g].digests])
                  for g, first in enumerate(batches[0].start)]
        out.append(pb.BlockContent(rank=per_rank[0].rank, groups=groups))
    return out


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


def expected(remote_ids: list[list[int]], sent: Sequence[pb.BlockContent]) -> dict[int, dict[tuple[int, int], int]]:
    """Per P rank, the digest of each block (group, block id) of a lease made whole, as the
    claim's answer gave them (in the order of the lease's block ids)."""
    return {c.rank: {(g, b): d for g, gc in enumerate(c.groups)
                     for b, d in zip(remote_ids[g] if g < len(remote_ids) else [], gc.digests, strict=False)}
            for c in sent}


def check(request_id: str, expected: dict[int, dict[tuple[int, int], int]],
          got: dict[int, tuple[dict[tuple[int, int], int], int]]) -> tuple[int, int]:
    """Compare what landed with what P sent; (blocks checked, blocks not checked). Raises
    DataLoss (DIGEST_MISMATCH) naming the first block that differs."""
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
