"""Content digests of KV blocks: what P leased, checked against what landed on D.

A block's digest is a BLAKE2b of 8 bytes (personalised "kvsvc-kv") over its bytes in every
region of its group, in region order -- P's bytes, in P's geometry. P takes one per leased
block when the lease is made (block_digests). D rebuilds the same byte stream from what its
READs landed (landed_digests): its READ pieces sorted by where they came from in P's
memory, each P block's bytes in order, so the check holds across TP sizes, memory orders and
block shapes alike. A P block D did not read whole (a D engine whose ranks are split over
several servers, replicated heads read from another P rank) is not checked, and counted so.

Host memory only (both sides read it through its address); GPU memory is not digested.
Pure: numpy, hashlib and ctypes; no grpc, NIXL or torch.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.layout.regions import Region

PERSON = b"kvsvc-kv"


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=8, person=PERSON)


def _memory(address: int, length: int) -> memoryview:
    """Host memory at address, as bytes (no copy)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def _extent(r: Region) -> int:
    return (r.num_blocks - 1) * r.block_stride + r.block_len if r.num_blocks else 0


def by_group(regions: Sequence[Region]) -> dict[int, list[Region]]:
    out: dict[int, list[Region]] = {}
    for r in sorted(regions, key=lambda r: r.index):
        out.setdefault(r.group_index, []).append(r)
    return out


def block_digests(regions: Sequence[Region], address_of: Callable[[Region], int],
                  block_ids_per_group: Sequence[Sequence[int]]) -> list[list[int]]:
    """P: each leased block's digest, per group in the lease's order of its block ids."""
    groups = by_group(regions)
    out = []
    for g, ids in enumerate(block_ids_per_group):
        views = [(_memory(address_of(r), _extent(r)), r) for r in groups.get(g, [])]
        digests = []
        for b in ids:
            h = _hasher()
            for mem, r in views:
                h.update(mem[b * r.block_stride:b * r.block_stride + r.block_len])
            digests.append(int.from_bytes(h.digest(), "little"))
        out.append(digests)
    return out


@dataclass
class _Pieces:
    """READ pieces cut at P's block boundaries, ordered by P block, region and offset: P's
    group and block, the region (position in region order), the piece's start and end in
    the region's block, and where it landed."""

    group: np.ndarray
    block: np.ndarray
    region: np.ndarray
    start: np.ndarray
    end: np.ndarray
    landed: np.ndarray


def _pieces(regions: list[Region], p_bases: np.ndarray, local: np.ndarray, remote: np.ndarray,
            lengths: np.ndarray) -> _Pieces:
    idx = np.array([r.index for r in regions], np.int64)
    bases = np.asarray(p_bases, np.int64)[idx]
    stride = np.array([r.block_stride for r in regions], np.int64)
    blen = np.array([r.block_len for r in regions], np.int64)
    group = np.array([r.group_index for r in regions], np.int64)
    order = np.argsort(bases)
    local, remote, lengths = (np.asarray(a, np.int64) for a in (local, remote, lengths))
    reg = order[np.searchsorted(bases[order], remote, side="right") - 1]  # position in `regions`
    off = remote - bases[reg]
    first, last = off // stride[reg], (off + lengths - 1) // stride[reg]
    # A READ of several contiguous blocks is cut at block boundaries.
    n = last - first + 1
    piece = np.repeat(np.arange(len(lengths)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    reg, blk = reg[piece], first[piece] + k
    begin = blk * stride[reg]
    start = np.maximum(off[piece], begin) - begin
    end = np.minimum(off[piece] + lengths[piece], begin + blen[reg]) - begin
    landed = local[piece] + (begin + start - off[piece])
    keys = np.lexsort((end, start, reg, blk, group[reg]))
    p = _Pieces(group[reg][keys], blk[keys], reg[keys], start[keys], end[keys], landed[keys])
    # The same P bytes read twice (two D ranks holding one replicated head) count once.
    dup = np.zeros(len(p.group), bool)
    dup[1:] = ((p.group[1:] == p.group[:-1]) & (p.block[1:] == p.block[:-1]) & (p.region[1:] == p.region[:-1])
               & (p.start[1:] == p.start[:-1]) & (p.end[1:] == p.end[:-1]))
    return _Pieces(*(a[~dup] for a in (p.group, p.block, p.region, p.start, p.end, p.landed)))


def _whole(p: _Pieces, regions: list[Region]) -> tuple[np.ndarray, np.ndarray]:
    """Per piece, the index of its P block; per P block, whether the pieces cover it whole:
    in each region of its group, from 0 to the block's length without a gap or overlap."""
    blen = np.array([r.block_len for r in regions], np.int64)
    per_group = np.bincount(np.array([r.group_index for r in regions], np.int64))
    new_run = np.ones(len(p.group), bool)  # a run: one region's block
    new_run[1:] = (p.block[1:] != p.block[:-1]) | (p.region[1:] != p.region[:-1]) | (p.group[1:] != p.group[:-1])
    prev_end = np.where(new_run, 0, np.concatenate(([0], p.end[:-1])))
    run = np.cumsum(new_run) - 1
    run_ok = np.ones(int(run[-1]) + 1, bool)
    np.logical_and.at(run_ok, run, p.start == prev_end)
    run_last = np.r_[np.nonzero(new_run)[0][1:] - 1, len(p.group) - 1]
    run_ok &= p.end[run_last] == blen[p.region[run_last]]
    run_group, run_block = p.group[run_last], p.block[run_last]
    new_block = np.ones(len(run_group), bool)
    new_block[1:] = (run_group[1:] != run_group[:-1]) | (run_block[1:] != run_block[:-1])
    block_of_run = np.cumsum(new_block) - 1
    whole_runs = np.zeros(int(block_of_run[-1]) + 1, np.int64)
    np.add.at(whole_runs, block_of_run, run_ok.astype(np.int64))
    return block_of_run[run], whole_runs == per_group[run_group[new_block]]


def landed_digests(p_regions: Sequence[Region], p_bases: np.ndarray, local: np.ndarray, remote: np.ndarray,
                   lengths: np.ndarray) -> tuple[dict[tuple[int, int], int], int]:
    """D: the digest of every P block (group, block id) of one P rank whose bytes the READs
    (local address, remote address, length) landed whole, and how many P blocks they
    touched without covering them whole (not checked)."""
    if not len(lengths):
        return {}, 0
    regions = sorted(p_regions, key=lambda r: r.index)
    p = _pieces(regions, p_bases, local, remote, lengths)
    block, whole = _whole(p, regions)
    digests: dict[tuple[int, int], int] = {}
    bounds = np.r_[np.nonzero(np.r_[True, block[1:] != block[:-1]])[0], len(block)]
    sizes = (p.end - p.start).tolist()
    landed = p.landed.tolist()
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        if not whole[block[lo]]:
            continue
        h = _hasher()
        for i in range(lo, hi):
            h.update(_memory(landed[i], sizes[i]))
        digests[(int(p.group[lo]), int(p.block[lo]))] = int.from_bytes(h.digest(), "little")
    return digests, int((~whole).sum())
