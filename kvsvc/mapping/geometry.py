"""Descriptor geometry: the byte ranges one local rank reads from each remote rank (MAPPING.md §4).

Every attention block is seen as [heads, tokens, row] (HND) or [tokens, heads, row]
(NHD). A local block of n·T remote tokens is filled from n remote blocks; a local head
takes its bytes from one remote rank and head, chosen by the TP mapping. Where both
sides are HND a head of a block is one run; where both are NHD and heads are not split
the whole block is one run (heads folded into the row); otherwise (NHD with heads split,
or the two sides in different orders) a unit is one token's row of a run of heads
(MAPPING.md §4). Units are generated with numpy and contiguous runs (both locally and
remotely) are merged into one descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.errors import InvalidArgument
from kvsvc.layout.regions import Region, RegionKind
from kvsvc.mapping.tp_mapping import TPMapping
from kvsvc.reasons import Reason

I64 = np.int64


@dataclass(frozen=True, slots=True)
class Reads:
    """Coalesced reads of one local rank from one remote rank; offsets from region block 0."""

    remote_rank: int
    local_region: np.ndarray
    local_offset: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True, slots=True)
class Units:
    local_region: np.ndarray
    local_offset: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray


HeadRun = tuple[int, int, int, int]
"""(first local head, count, remote rank, first remote head): local heads read together."""


def head_runs(a: Region, b: Region, mapping: TPMapping, attn_sources: Sequence[int], ratio: int) -> list[HeadRun]:
    """The head runs of an attention or latent region pair (what attention_units reads per block).

    Two NHD regions whose block is read whole get the one folded run (0, 1, rank, 0): heads
    are then part of the row, and a block is one run however many heads it holds."""
    runs = _head_runs(a.heads, mapping, attn_sources, b.heads, ratio, latent=a.kind is RegionKind.LATENT)
    if not a.head_major and not b.head_major and a.heads == b.heads and len(runs) == 1 and runs[0][::3] == (0, 0) \
            and runs[0][1] == a.heads:
        return [(0, 1, runs[0][2], 0)]
    return runs


def _folded(a: Region, b: Region, runs: Sequence[HeadRun]) -> bool:
    """Both NHD, heads not split: head_runs folded the heads into the row."""
    return not a.head_major and not b.head_major and a.heads == b.heads and len(runs) == 1 \
        and runs[0][1] == 1 and runs[0][::3] == (0, 0)


def _head_runs(
    local_heads: int, mapping: TPMapping, attn_sources: Sequence[int], remote_heads: int, ratio: int, latent: bool
) -> list[HeadRun]:
    """(first local head, count, remote rank, first remote head) runs for one region."""
    pairs: list[tuple[int, int]] = []
    for hl in range(local_heads):
        if latent or ratio > 0:
            off = 0 if latent else mapping.rank_offset_factor * local_heads
            pairs.append((attn_sources[0], off + hl))
        else:
            pairs.append((attn_sources[hl // remote_heads], hl % remote_heads))
    runs: list[HeadRun] = []
    for hl, (r, hr) in enumerate(pairs):
        if runs and runs[-1][2] == r and runs[-1][3] + runs[-1][1] == hr:
            h0, c, r0, hr0 = runs[-1]
            runs[-1] = (h0, c + 1, r0, hr0)
        else:
            runs.append((hl, 1, r, hr))
    return runs


def region_shape(r: Region) -> tuple[object, ...]:
    """What the units of a region depend on besides its index: regions of one shape (the
    layers of a group, K and V alike) get the same offsets, so a plan computes them once."""
    return (r.kind, r.group_index, r.block_len, r.block_stride, r.heads, r.tokens, r.head_bytes, r.head_major)


def attention_units(
    a: Region, b: Region, local_ids: np.ndarray, remote_ids: np.ndarray, n: int,
    mapping: TPMapping, attn_sources: Sequence[int], ratio: int, runs: Sequence[HeadRun] | None = None,
) -> dict[int, Units]:
    """Units of an attention or latent region pair, keyed by remote rank (runs: the pair's
    head_runs, when the caller has them)."""
    row = a.head_bytes if a.head_major else a.heads * a.head_bytes
    chunk = b.tokens * row  # one head of one remote block
    if runs is None:
        runs = head_runs(a, b, mapping, attn_sources, ratio)
    if not (a.head_major and b.head_major) and not _folded(a, b, runs):
        return _token_units(a, b, local_ids, remote_ids, n, runs)
    m, rc = local_ids.size, remote_ids.size
    out: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    if n == 1:
        for h0, cnt, r, hr0 in runs:
            lo = local_ids * a.block_stride + h0 * chunk
            ro = remote_ids * b.block_stride + hr0 * chunk
            out.setdefault(r, []).append((lo, ro, np.full(m, cnt * chunk, I64)))
    else:
        i = np.arange(m, dtype=I64)[:, None]
        k = np.arange(n, dtype=I64)[None, :]
        flat = i * n + k
        valid = flat < rc
        rid = remote_ids[np.minimum(flat, rc - 1)]
        local_head_stride = a.tokens * row
        for h0, cnt, r, hr0 in runs:
            for h in range(cnt):
                lo = local_ids[:, None] * a.block_stride + (h0 + h) * local_head_stride + k * chunk
                ro = rid * b.block_stride + (hr0 + h) * chunk
                out.setdefault(r, []).append((lo[valid], ro[valid], np.full(int(valid.sum()), chunk, I64)))
    return {r: _stack(a.index, b.index, parts) for r, parts in out.items()}


def _strides(r: Region) -> tuple[int, int]:
    """(head stride, token stride) in bytes inside one block of r."""
    return (r.tokens * r.head_bytes, r.head_bytes) if r.head_major else (r.head_bytes, r.heads * r.head_bytes)


def _token_units(a: Region, b: Region, local_ids: np.ndarray, remote_ids: np.ndarray, n: int,
                 runs: Sequence[HeadRun]) -> dict[int, Units]:
    """Units of one token's row each: NHD with heads split, or the sides in different orders.

    In one order (both NHD) a unit is a run of heads of one token, contiguous on both sides;
    in different orders a unit is one head of one token (a head's tokens are contiguous on
    the HND side only). Sorted by local offset, so that coalescing joins what is contiguous
    on both sides (a local block whose heads all come from one remote rank's whole block).
    """
    hb = a.head_bytes
    (a_hs, a_ts), (b_hs, b_ts) = _strides(a), _strides(b)
    same_order = a.head_major == b.head_major
    m, rc, tb = local_ids.size, remote_ids.size, b.tokens
    k = np.arange(n, dtype=I64)[None, :]
    flat = np.arange(m, dtype=I64)[:, None] * n + k
    valid = np.broadcast_to((flat < rc)[:, :, None], (m, n, tb))
    rid = remote_ids[np.minimum(flat, rc - 1)]
    t = np.arange(tb, dtype=I64)[None, None, :]
    local_base = (local_ids[:, None, None] * a.block_stride + (k[:, :, None] * tb + t) * a_ts)[valid]
    remote_base = (rid[:, :, None] * b.block_stride + t * b_ts)[valid]
    out: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for h0, cnt, r, hr0 in runs:
        pieces = [(h0, hr0, cnt)] if same_order else [(h0 + h, hr0 + h, 1) for h in range(cnt)]
        for hl, hr, c in pieces:
            out.setdefault(r, []).append((local_base + hl * a_hs, remote_base + hr * b_hs,
                                          np.full(local_base.size, c * hb, I64)))
    made = {}
    for r, parts in out.items():
        u = _stack(a.index, b.index, parts)
        order = np.argsort(u.local_offset, kind="stable")
        made[r] = Units(u.local_region, u.local_offset[order], u.remote_region, u.remote_offset[order],
                        u.length[order])
    return made


def ssm_units(
    a: Region, b: Region, local_ids: np.ndarray, remote_ids: np.ndarray, ssm_sources: Sequence[int],
    local_rank: int, local_tp: int, remote_tp: int,
) -> dict[int, Units]:
    """Units of one SSM state region pair: state is sharded contiguously across TP."""
    out: dict[int, Units] = {}
    if local_tp < remote_tp:
        for j, r in enumerate(ssm_sources):
            lo = local_ids * a.block_stride + j * b.block_len
            ro = remote_ids * b.block_stride
            out[r] = _stack(a.index, b.index, [(lo, ro, np.full(local_ids.size, b.block_len, I64))])
    else:
        c = local_rank % (local_tp // remote_tp)
        lo = local_ids * a.block_stride
        ro = remote_ids * b.block_stride + c * a.block_len
        out[ssm_sources[0]] = _stack(a.index, b.index, [(lo, ro, np.full(local_ids.size, a.block_len, I64))])
    return out


def _stack(la: int, rb: int, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Units:
    if len(parts) == 1:  # the common case: numpy's per-call cost is most of a short plan
        lo, ro, ln = (np.asarray(x, I64).ravel() for x in parts[0])
    else:
        lo = np.concatenate([p[0].ravel() for p in parts]).astype(I64)
        ro = np.concatenate([p[1].ravel() for p in parts]).astype(I64)
        ln = np.concatenate([p[2].ravel() for p in parts]).astype(I64)
    return Units(np.full(lo.size, la, np.int32), lo, np.full(lo.size, rb, np.int32), ro, ln)


def coalesce(remote_rank: int, units: Sequence[Units], ordered: bool = False) -> Reads:
    """Region-major, local-offset order; merge runs contiguous on both sides.

    ordered: the units already come region-major in local-offset order (the planner
    sorts blocks once per group), so the sort is skipped.
    """
    if not units:
        e = np.zeros(0, I64)
        return Reads(remote_rank, e.astype(np.int32), e, e.astype(np.int32), e, e)
    if len(units) == 1:
        u = units[0]
        lr, lo, rr, ro, ln = u.local_region, u.local_offset, u.remote_region, u.remote_offset, u.length
    else:
        lr = np.concatenate([u.local_region for u in units])
        lo = np.concatenate([u.local_offset for u in units])
        rr = np.concatenate([u.remote_region for u in units])
        ro = np.concatenate([u.remote_offset for u in units])
        ln = np.concatenate([u.length for u in units])
    if not ordered:
        order = np.lexsort((lo, lr))
        lr, lo, rr, ro, ln = lr[order], lo[order], rr[order], ro[order], ln[order]
    if lo.size > 1:
        joins = (
            (lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1])
            & (lo[1:] == lo[:-1] + ln[:-1]) & (ro[1:] == ro[:-1] + ln[:-1])
        )
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    else:
        starts = np.zeros(lo.size, dtype=np.intp)
    return Reads(remote_rank, lr[starts], lo[starts], rr[starts], ro[starts], np.add.reduceat(ln, starts))


def repeat_over_regions(remote_rank: int, parts: Sequence[tuple[Reads, np.ndarray]]) -> Reads:
    """One remote rank's reads from coalesced templates, each repeated over region pairs.

    parts: (template, region indices): local region i reads remote region i, and a
    template's offsets hold for every pair of its shapes (joins never cross regions, so
    coalescing one pair is coalescing them all). The result is region-major like
    coalesce's: parts are merged by region, a stable sort that keeps each region's order.
    """
    if not parts:
        return coalesce(remote_rank, ())
    lr = np.concatenate([np.repeat(idx.astype(np.int32), t.num_descriptors) for t, idx in parts])
    lo = np.concatenate([_tile(t.local_offset, idx.size) for t, idx in parts])
    ro = np.concatenate([_tile(t.remote_offset, idx.size) for t, idx in parts])
    ln = np.concatenate([_tile(t.length, idx.size) for t, idx in parts])
    if len(parts) > 1 and lr.size > 1 and bool((lr[1:] < lr[:-1]).any()):
        order = np.argsort(lr, kind="stable")
        lr, lo, ro, ln = lr[order], lo[order], ro[order], ln[order]
    return Reads(remote_rank, lr, lo, lr, ro, ln)


def _tile(a: np.ndarray, times: int) -> np.ndarray:
    if times <= 16:  # the common few layers per class: np.tile's own overhead would dominate
        return np.concatenate([a] * times) if times > 1 else a
    return np.broadcast_to(a, (times, a.size)).reshape(-1)


def check_block_ids(ids: np.ndarray, num_blocks: int, *, side: str, group: int) -> None:
    """BLOCK_OUT_OF_RANGE / DUPLICATE_BLOCK_ID: never read or write outside the pool."""
    if ids.size == 0:
        return
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise InvalidArgument(
            Reason.BLOCK_OUT_OF_RANGE,
            f"{side} block id {int(bad[0])} of group {group} is outside [0, {num_blocks})",
            {"side": side, "group": group, "block_id": int(bad[0]), "num_blocks": num_blocks,
             "num_bad": int(bad.size)},
        )
    if side == "local" and ids.size > 1 and np.unique(ids).size != ids.size:
        uniq, counts = np.unique(ids, return_counts=True)
        raise InvalidArgument(
            Reason.DUPLICATE_BLOCK_ID,
            f"local block id {int(uniq[counts > 1][0])} of group {group} appears more than once",
            {"side": side, "group": group, "block_id": int(uniq[counts > 1][0])},
        )
