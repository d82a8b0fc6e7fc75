"""An independent reference for KV transfers: what every D rank must hold, from first principles.

Nothing here imports kvsvc.mapping. The model's logical KV (every global head of every
layer and token, every SSM state byte) is filled deterministically; each rank's shard
is cut from it by the plain sharding rules of TP attention; a check compares a D rank's
blocks against the expected shard element by element.

Element tags (int32 pairs for attention rows, so any misplaced row is named):
    attention row (layer region x, global head h, global token p): [tag(x, h), p]
    latent row (region x, token p): [tag(x, 0), p]
    SSM state byte of region x at full-state byte index q: derived from (x, q)

Decode context parallelism: an engine with DCP size d keeps the request's block
i·d + (rank mod d) at position i of a rank's list (d = 1: block i), so the token
numbers in a latent row say which request block a D position was filled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsvc.layout.regions import Region, RegionKind


def rank_heads(rank: int, tp: int, k: int) -> list[int]:
    """Global heads a rank owns under TP attention: K/tp consecutive heads, or one replicated head."""
    if tp <= k:
        per = k // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * k // tp]


def tag(region: int, head: int) -> int:
    return region * 10_000 + head + 1  # +1: zero never names a valid row


def ssm_byte(region: int, q: np.ndarray) -> np.ndarray:
    return ((q * 31 + region * 7 + 1) % 251 + 1).astype(np.uint8)


@dataclass
class RankMemory:
    """One rank's KV memory with the regions that structure it: one pool as a byte array, or
    (an engine's own per-layer tensors) one uint8 [num_blocks, >= block_len] array per region."""

    regions: tuple[Region, ...]
    buf: np.ndarray | None  # uint8 pool; None when per_region is given
    per_region: list[np.ndarray] | None = None

    def block_view(self, r: Region, block: int) -> np.ndarray:
        if self.per_region is not None:
            return self.per_region[r.index][block, :r.block_len]
        assert self.buf is not None
        start = r.pool_offset + block * r.block_stride
        return self.buf[start:start + r.block_len]


def _rows(r: Region, view: np.ndarray) -> np.ndarray:
    """A block of an attention/latent region as [heads, tokens, 2] int32 (HND) regardless of order."""
    words = view.view(np.int32)
    per_row = r.head_bytes // 4
    if r.kind is RegionKind.LATENT:
        return words.reshape(1, r.tokens, per_row)[..., :2]
    if r.head_major:
        return words.reshape(r.heads, r.tokens, per_row)[..., :2]
    return words.reshape(r.tokens, r.heads, per_row).transpose(1, 0, 2)[..., :2]


def request_block(position: int, rank: int, dcp_size: int) -> int:
    """The request block held at a list position of a rank of an engine with DCP size dcp_size."""
    return position * dcp_size + rank % dcp_size


def fill_rank(mem: RankMemory, rank: int, tp: int, k: int, block_ids: list[list[int]], block_size: int,
              dcp_size: int = 1) -> None:
    """Write rank's shard of the logical KV of one request into its blocks (position i of a group's list
    holds request block request_block(i, rank, dcp_size), tokens from block·block_size)."""
    heads = rank_heads(rank, tp, k)
    for r in mem.regions:
        ids = block_ids[r.group_index]
        for i, b in enumerate(ids):
            view = mem.block_view(r, b)
            if r.kind is RegionKind.SSM_STATE:
                q = rank * r.block_len + np.arange(r.block_len)  # the rank's slice of the full state
                view[:] = ssm_byte(r.index, q + i * 100_003)
                continue
            rows = _rows(r, view)
            toks = request_block(i, rank, dcp_size) * block_size + np.arange(r.tokens)
            hs = [0] if r.kind is RegionKind.LATENT else heads
            for hpos, h in enumerate(hs):
                rows[hpos, :, 0] = tag(r.index, h)
                rows[hpos, :, 1] = toks


def check_rank(mem: RankMemory, rank: int, tp: int, k: int, block_ids: list[list[int]], block_size: int,
               first_position: list[int] | None = None, dcp_size: int = 1,
               num_tokens: int | None = None) -> list[str]:
    """Every mismatch between a D rank's blocks and its expected shard (empty: all good).

    first_position[g] is the list position of block_ids[g][0] (a prefix-cache hit starts later).
    With num_tokens, positions past the request's last block are not checked (under DCP a
    rank's last position may lie past the end).
    """
    last = None if num_tokens is None else -(-num_tokens // block_size)
    errors: list[str] = []
    heads = rank_heads(rank, tp, k)
    for r in mem.regions:
        ids = block_ids[r.group_index]
        start = (first_position or [0] * 64)[r.group_index]
        for i, b in enumerate(ids):
            pos = start + i
            view = mem.block_view(r, b)
            if r.kind is RegionKind.SSM_STATE:
                q = rank * r.block_len + np.arange(r.block_len)
                want = ssm_byte(r.index, q + pos * 100_003)
                if not np.array_equal(view, want):
                    errors.append(f"region {r.index} block {b}: SSM bytes differ at {int(np.argmax(view != want))}")
                continue
            block = request_block(pos, rank, dcp_size)
            if last is not None and block >= last:
                continue
            rows = _rows(r, view)
            toks = block * block_size + np.arange(r.tokens)
            hs = [0] if r.kind is RegionKind.LATENT else heads
            for hpos, h in enumerate(hs):
                got_tag, got_tok = rows[hpos, :, 0], rows[hpos, :, 1]
                if not (np.all(got_tag == tag(r.index, h)) and np.array_equal(got_tok, toks)):
                    bad = int(np.argmax((got_tag != tag(r.index, h)) | (got_tok != toks)))
                    errors.append(
                        f"region {r.index} block {b} head slot {hpos}: want head {h} token {toks[bad]}, "
                        f"got tag {int(got_tag[bad])} token {int(got_tok[bad])}")
                    break
    return errors
