"""Content digests (kvsvc/memory/content.py) on real memory: what D rebuilds from READ
pieces -- cut, reordered, duplicated, spread over several D blocks -- equals what P took of
its blocks; a byte changed, a piece missing or a piece from another block never passes
as whole and equal. The servers' side is tests/e2e/test_content_digest.py."""

from __future__ import annotations

import numpy as np

from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout
from kvsvc.memory.content import block_digests, landed_digests

TABLE = {"model_id": "cd", "total_num_kv_heads": 2, "block_size": 4, "num_blocks": 8, "dtype": "float16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 8},
                    {"name": "swa", "kind": "sliding_window", "num_layers": 1, "head_size": 8, "sliding_window": 8}]}


class Side:
    """One rank's regions over arrays of its own (P random, D zero)."""

    def __init__(self, seed: int | None) -> None:
        self.regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
        rng = np.random.default_rng(seed)
        self.mem = [rng.integers(0, 255, (r.num_blocks, r.block_stride), dtype=np.uint8) if seed is not None
                    else np.zeros((r.num_blocks, r.block_stride), np.uint8) for r in self.regions]
        self.bases = np.array([m.ctypes.data for m in self.mem], np.int64)

    def address(self, region, block: int, offset: int = 0) -> int:
        return int(self.bases[region.index]) + block * region.block_stride + offset


def copy(p: Side, d: Side, pieces: list[tuple[int, int, int, int, int, int]]) -> tuple[np.ndarray, ...]:
    """READ (region, P block, offset, D block, D offset, length) pieces for real; their addresses."""
    local, remote, lengths = [], [], []
    for ri, pb_, off, db, doff, n in pieces:
        r = p.regions[ri]
        at, to = pb_ * r.block_stride + off, db * r.block_stride + doff  # a piece may run over several blocks
        d.mem[ri].reshape(-1)[to:to + n] = p.mem[ri].reshape(-1)[at:at + n]
        local.append(d.address(r, db, doff))
        remote.append(p.address(r, pb_, off))
        lengths.append(n)
    return np.array(local), np.array(remote), np.array(lengths)


def whole_block_pieces(p: Side, blocks: dict[int, int], group: int, halves: bool = False) -> list[tuple]:
    """Every region of the group, P block -> D block, whole or cut in two halves."""
    out = []
    for r in p.regions:
        if r.group_index != group:
            continue
        for pb_, db in blocks.items():
            n = r.block_len
            out += ([(r.index, pb_, 0, db, 0, n // 2), (r.index, pb_, n // 2, db, n // 2, n - n // 2)] if halves
                    else [(r.index, pb_, 0, db, 0, n)])
    return out


def test_pieces_in_any_order_cut_and_read_twice_rebuild_ps_blocks():
    p, d = Side(1), Side(None)
    want = block_digests(p.regions, lambda r: int(p.bases[r.index]), [[3, 5, 6], [2]])
    pieces = whole_block_pieces(p, {3: 0, 5: 7, 6: 1}, 0, halves=True) + whole_block_pieces(p, {2: 4}, 1)
    pieces = pieces[::-1] + pieces[:3]  # reversed, and three pieces read twice
    got, partial = landed_digests(p.regions, p.bases, *copy(p, d, pieces))
    assert partial == 0
    assert got == {(0, 3): want[0][0], (0, 5): want[0][1], (0, 6): want[0][2], (1, 2): want[1][0]}


def test_a_read_of_contiguous_blocks_is_cut_at_their_boundaries():
    p, d = Side(2), Side(None)
    r0 = [r for r in p.regions if r.group_index == 0]
    assert all(r.block_stride == r.block_len for r in r0)
    pieces = [(r.index, 2, 0, 5, 0, 2 * r.block_len) for r in r0]  # P blocks 2-3 into D blocks 5-6
    got, partial = landed_digests(p.regions, p.bases, *copy(p, d, pieces))
    want = block_digests(p.regions, lambda r: int(p.bases[r.index]), [[2, 3], []])
    assert partial == 0 and got == {(0, 2): want[0][0], (0, 3): want[0][1]}


def test_a_changed_byte_differs_and_a_missing_piece_is_not_whole():
    p, d = Side(3), Side(None)
    want = block_digests(p.regions, lambda r: int(p.bases[r.index]), [[4], []])
    local, remote, lengths = copy(p, d, whole_block_pieces(p, {4: 2}, 0))
    d.mem[0][2, 7] ^= 0x40  # one bit flipped where the block landed
    got, _ = landed_digests(p.regions, p.bases, local, remote, lengths)
    assert got[(0, 4)] != want[0][0]
    # The last region's block not read: the block is not whole, so it is not checked at all.
    got, partial = landed_digests(p.regions, p.bases, local[:-1], remote[:-1], lengths[:-1])
    assert got == {} and partial == 1
    # A piece short by a byte at the end, or overlapping its neighbour: not whole either.
    n = int(lengths[0])
    short = lengths.copy()
    short[0] = n - 1
    assert landed_digests(p.regions, p.bases, local, remote, short) == ({}, 1)
    over = np.r_[local, local[0]], np.r_[remote, remote[0] + 2], np.r_[lengths, 4]
    assert landed_digests(p.regions, p.bases, *over) == ({}, 1)
