"""Plan one local rank's reads for one request: mapping + geometry + prefix trimming."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.layout.compat import check_compatibility
from kvsvc.layout.engine import EngineLayout
from kvsvc.layout.kinds import policy_of
from kvsvc.layout.regions import PoolLayout, Region, build_pool_layout
from kvsvc.layout.specs import SpecFamily
from kvsvc.mapping.dcp import DcpGroup, dcp_group
from kvsvc.mapping.geometry import (
    HeadRun,
    Reads,
    Units,
    attention_units,
    check_block_ids,
    coalesce,
    head_runs,
    region_shape,
    repeat_over_regions,
    ssm_units,
)
from kvsvc.mapping.topology import TransferTopology, handshake_target_ranks, tp_ratio
from kvsvc.mapping.tp_mapping import TPMapping, compute_tp_mapping
from kvsvc.reasons import Reason


@dataclass(frozen=True, slots=True)
class Side:
    """One engine's side of a transfer: its layout, TP size and (derived) pool layout."""

    layout: EngineLayout
    tp_size: int
    pool: PoolLayout
    # Per region, a number shared by the regions of one shape (geometry.region_shape): a
    # plan computes the reads of one region per shape and repeats them over the others.
    shape_ids: tuple[int, ...] = field(init=False, compare=False, repr=False)
    # Per region, its layer's place among its group's layers: a read of some layers only
    # (a chunk committed layer by layer) keeps the regions of those.
    layer_places: np.ndarray = field(init=False, compare=False, repr=False)
    # Hashed once: plans look their pair of sides up per request (_rank_work), and hashing
    # a layout's every region each time cost ~50 us for 80 layers.
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape_ids", _shape_ids(self.pool))
        object.__setattr__(self, "layer_places", _layer_places(self.layout, self.pool))
        object.__setattr__(self, "_hash", hash((self.layout, self.tp_size, self.pool)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, layout: EngineLayout, tp_size: int) -> Side:
        return cls(layout, tp_size, build_pool_layout(layout))


def _shape_ids(pool: PoolLayout) -> tuple[int, ...]:
    ids: dict[tuple[object, ...], int] = {}
    return tuple(ids.setdefault(region_shape(r), len(ids)) for r in pool.regions)


def _layer_places(layout: EngineLayout, pool: PoolLayout) -> np.ndarray:
    places = [{name: i for i, (name, _) in enumerate(group.layers())} for group in layout.groups]
    return np.array([places[r.group_index][r.layer_name] for r in pool.regions], dtype=np.int64)


Layers = tuple[int, int | None]
"""Layers [a, b) of every group (b None: to the group's last)."""


@functools.lru_cache(maxsize=256)
def _region_classes(local_shapes: tuple[int, ...], remote_shapes: tuple[int, ...]) -> tuple[tuple[int, np.ndarray], ...]:
    """Region pairs (local region i reads remote region i) grouped by the shapes of both:
    (first region, every region) per class, in order of first appearance. Cached: a server
    meets few layouts, and this is per request otherwise."""
    classes: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(local_shapes, remote_shapes, strict=True)):
        classes.setdefault(key, []).append(i)
    return tuple((members[0], np.array(members)) for members in classes.values())


@dataclass(frozen=True, slots=True)
class _ClassWork:
    """One class of region pairs (see _region_classes) as a local rank reads it."""

    local: Region  # the class's first pair: its reads are repeated over `members`
    remote: Region
    members: np.ndarray
    sources: tuple[int, ...]  # remote ranks this rank reads the class's group from
    runs: tuple[HeadRun, ...]  # attention and latent regions: local heads by remote rank


@dataclass(frozen=True, slots=True)
class _RankWork:
    """What a plan of one local rank depends on besides the request's blocks."""

    ratio: int
    mapping: TPMapping
    targets: tuple[int, ...]
    classes: tuple[_ClassWork, ...]


@functools.lru_cache(maxsize=1024)
def _rank_work(local: Side, remote: Side, local_rank: int) -> _RankWork:
    """Cached per pair of sides and rank: a server plans against few peers' layouts, and
    this part (TP mapping, handshake targets, head runs per class) was a third of a
    short request's plan."""
    lay = local.layout
    ratio = tp_ratio(local.tp_size, remote.tp_size)
    rdcp = remote.layout.dcp_size
    topo = TransferTopology(local_rank, local.tp_size, lay.total_num_kv_heads, lay.is_mla, lay.block_size,
                            dcp_size=lay.dcp_size)
    mapping = compute_tp_mapping(topo, remote.tp_size, lay.group_spec_types, rdcp)
    classes = []
    for first, members in _region_classes(local.shape_ids, remote.shape_ids):
        a, b = local.pool.regions[first], remote.pool.regions[first]
        sources = tuple(mapping.source_ranks_per_group[a.group_index])
        runs = () if a.is_ssm else tuple(head_runs(a, b, mapping, sources, ratio))
        classes.append(_ClassWork(a, b, members, sources, runs))
    targets = tuple(handshake_target_ranks(local_rank, local.tp_size, remote.tp_size, lay.dcp_size, rdcp))
    return _RankWork(ratio, mapping, targets, tuple(classes))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one local rank reads: per source rank, coalesced byte ranges."""

    local_rank: int
    tp_ratio: int
    handshake_target_ranks: tuple[int, ...]
    mapping: TPMapping
    reads: tuple[Reads, ...]
    prefix_blocks_skipped: tuple[int, ...]

    @property
    def notify_only_ranks(self) -> tuple[int, ...]:
        """Handshake targets read from for no group: they are still notified (P-side id)."""
        read = {r.remote_rank for r in self.reads if r.num_descriptors}
        return tuple(r for r in self.handshake_target_ranks if r not in read)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.reads)


def validate_pair(local: Side, remote: Side) -> None:
    """FAILED_PRECONDITION listing every violated compatibility rule."""
    violations = check_compatibility(local.layout, local.tp_size, remote.layout, remote.tp_size)
    if violations:
        first = violations[0]
        meta = dict(first.metadata)
        meta["violations"] = ",".join(v.reason for v in violations)
        raise FailedPrecondition(
            first.reason if len(violations) == 1 else violations[0].reason,
            "incompatible layouts: " + "; ".join(f"[{v.reason}] {v.message}" for v in violations),
            meta,
            details=tuple(violations),
        )


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def trim_prefix(local_ids: np.ndarray, remote_ids: np.ndarray, ratio: int, *, group: int, ssm: bool) -> tuple[np.ndarray, int]:
    """The remote ids to read and how many local blocks the prefix hit skipped.

    A local list shorter than the remote data means the local side already holds a
    prefix (whole local blocks): only the tail of the remote list is read.
    """
    if ssm:
        if local_ids.size != remote_ids.size:
            raise InvalidArgument(
                Reason.BLOCK_COUNT_MISMATCH,
                f"SSM group {group} needs one local block per remote block: {local_ids.size} vs {remote_ids.size}",
                {"group": group, "local_blocks": local_ids.size, "remote_blocks": remote_ids.size},
            )
        return remote_ids, 0
    needed = -(-remote_ids.size // ratio)
    if local_ids.size > needed:
        raise InvalidArgument(
            Reason.BLOCK_COUNT_MISMATCH,
            f"group {group}: {local_ids.size} local blocks but the remote holds only {remote_ids.size} blocks "
            f"({needed} local blocks of {ratio} remote ones)",
            {"group": group, "local_blocks": local_ids.size, "remote_blocks": remote_ids.size, "block_ratio": ratio},
        )
    prefix = needed - local_ids.size
    return remote_ids[prefix * ratio:], prefix


def _request_part(rids: np.ndarray, num_tokens: int, block_size: int, group: int) -> np.ndarray:
    """The remote ids that hold the request's tokens: a list may end in allocated, unfilled blocks."""
    needed = -(-num_tokens // block_size)
    if rids.size < needed:
        raise InvalidArgument(
            Reason.BLOCK_COUNT_MISMATCH,
            f"group {group}: {num_tokens} tokens fill {needed} remote blocks of {block_size}, got {rids.size} ids",
            {"group": group, "remote_blocks": int(rids.size), "needed": needed, "num_tokens": num_tokens})
    return rids[:needed]


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request's block ids, checked and paired once for every local rank.

    ids[g] = (local ids, remote ids to read) of group g, sorted by local id where that
    lets coalescing skip its sort; skipped[g] = local blocks a prefix hit skipped.
    dcp[g]: the group's pairing under DCP (§9), which differs per local and remote rank;
    None for a group (or a pair of engines) without DCP.
    """

    ids: tuple[tuple[np.ndarray, np.ndarray], ...]
    skipped: tuple[int, ...]
    block_ratio: int
    dcp: tuple[DcpGroup | None, ...] = ()


def prepare_blocks(
    local: Side, remote: Side, local_block_ids: Sequence[Sequence[int] | np.ndarray],
    remote_block_ids: Sequence[Sequence[int] | np.ndarray], remote_num_tokens: int = 0,
) -> RequestBlocks:
    """UNKNOWN_GROUP / BLOCK_OUT_OF_RANGE / DUPLICATE_BLOCK_ID / BLOCK_COUNT_MISMATCH, or the pairing.

    remote_num_tokens (the request's length, 0: not given) is needed when the remote
    engine uses DCP; without DCP on either side it is not used.
    """
    lay, rlay = local.layout, remote.layout
    ngroups = len(lay.groups)
    for name, given in (("local", local_block_ids), ("remote", remote_block_ids)):
        if len(given) != ngroups:
            raise InvalidArgument(
                Reason.UNKNOWN_GROUP,
                f"{name} block ids name {len(given)} groups but the layout has {ngroups}",
                {"side": name, "given_groups": len(given), "layout_groups": ngroups},
            )
    n = lay.block_size // rlay.block_size
    with_dcp = lay.dcp_size > 1 or rlay.dcp_size > 1
    ids: list[tuple[np.ndarray, np.ndarray]] = []
    skipped: list[int] = []
    dcp: list[DcpGroup | None] = []
    for g in range(ngroups):
        lids, rids = _as_ids(local_block_ids[g]), _as_ids(remote_block_ids[g])
        check_block_ids(lids, lay.group_blocks(g), side="local", group=g)
        check_block_ids(rids, rlay.group_blocks(g), side="remote", group=g)
        ssm = lay.groups[g].family is SpecFamily.SSM
        if with_dcp and not ssm:
            # Pairs depend on the local and the remote rank: kept in position order, paired per rank.
            grp = dcp_group(lids, rids, num_tokens=remote_num_tokens, block_size=lay.block_size,
                            local_dcp=lay.dcp_size, remote_dcp=rlay.dcp_size, group=g)
            ids.append((lids, rids))
            skipped.append(grp.computed)
            dcp.append(grp)
            continue
        dcp.append(None)
        if remote_num_tokens and policy_of(lay.groups[g].spec_type).blocks_cover_tokens:
            rids = _request_part(rids, remote_num_tokens, rlay.block_size, g)
        rids, prefix = trim_prefix(lids, rids, 1 if ssm else n, group=g, ssm=ssm)
        if n == 1 or ssm:
            # Blocks in local order once per group: every region's units then come out in
            # local-offset order and coalescing needs no sort (the 128k-token case).
            order = np.argsort(lids, kind="stable")
            lids, rids = lids[order], rids[order]
        ids.append((lids, rids))
        skipped.append(prefix)
    return RequestBlocks(tuple(ids), tuple(skipped), n, tuple(dcp) if with_dcp else ())


def plan_rank(
    local: Side,
    remote: Side,
    local_rank: int,
    local_block_ids: Sequence[Sequence[int] | np.ndarray] = (),
    remote_block_ids: Sequence[Sequence[int] | np.ndarray] = (),
    *,
    validated: bool = False,
    blocks: RequestBlocks | None = None,
    remote_num_tokens: int = 0,
    layers: Layers | None = None,
) -> RankPlan:
    """The reads of local_rank; raises InvalidArgument / FailedPrecondition on bad input.

    Pass blocks (from prepare_blocks) to plan several ranks of one request without
    checking its block ids again. layers: read only those layers of each group (a chunk
    committed layer by layer); local region i still reads remote region i, of one layer.
    """
    if not validated:
        validate_pair(local, remote)
    if blocks is None:
        blocks = prepare_blocks(local, remote, local_block_ids, remote_block_ids, remote_num_tokens)
    work = _rank_work(local, remote, local_rank)
    one = _one_block_template(local, remote, local_rank) if layers is None and _one_block_each(blocks) else None
    reads = one.shifted(blocks) if one is not None else _plan_reads(local, remote, local_rank, work, blocks, layers)
    return RankPlan(local_rank, work.ratio, work.targets, work.mapping, reads, blocks.skipped)


def _plan_reads(local: Side, remote: Side, local_rank: int, work: _RankWork,
                blocks: RequestBlocks, layers: Layers | None = None) -> tuple[Reads, ...]:
    mapping, ratio = work.mapping, work.ratio
    n = blocks.block_ratio
    ordered = n == 1 and not blocks.dcp  # DCP pairs keep the caller's order: sort when coalescing
    # A region pair's reads depend on its shapes, not its index: they are computed and
    # coalesced once per class of pairs, then repeated over every pair of the class (the
    # layers of a group). DCP regions are planned one by one (their pairs differ per rank).
    per_rank: dict[int, list[tuple[Reads, np.ndarray]]] = {}
    regions, remote_regions = local.pool.regions, remote.pool.regions
    for c in work.classes:
        a, b = c.local, c.remote
        lids, rids = blocks.ids[a.group_index]  # a class's regions share one group
        members = c.members if layers is None else _of_layers(local, c.members, layers)
        if lids.size == 0 or members.size == 0:
            continue
        grp = blocks.dcp[a.group_index] if blocks.dcp else None
        if grp is not None:
            for i in members:
                ai, bi = regions[i], remote_regions[i]
                units: dict[int, list[Units]] = {}
                for r in c.sources:  # each source fills the positions whose blocks it holds
                    pl, pr = grp.pairs(local_rank, r)
                    if pl.size:
                        for rr, u in attention_units(ai, bi, pl, pr, 1, mapping, (r,), ratio).items():
                            units.setdefault(rr, []).append(u)
                for rr, us in units.items():
                    per_rank.setdefault(rr, []).append((coalesce(rr, us), np.array([i])))
            continue
        made = (ssm_units(a, b, lids, rids, c.sources, local_rank, local.tp_size, remote.tp_size) if a.is_ssm
                else attention_units(a, b, lids, rids, n, mapping, c.sources, ratio, runs=c.runs))
        for r, u in made.items():
            per_rank.setdefault(r, []).append((coalesce(r, [u], ordered=ordered), members))
    return tuple(repeat_over_regions(r, per_rank[r]) for r in sorted(per_rank))


def _of_layers(side: Side, members: np.ndarray, layers: Layers) -> np.ndarray:
    """The regions among members whose layer is in [a, b) of its group. The units a class
    computes from its first region hold for every member (offsets are per region)."""
    a, b = layers
    places = side.layer_places[members]
    keep = places >= a if b is None else (places >= a) & (places < b)
    return members[keep]


def _one_block_each(blocks: RequestBlocks) -> bool:
    """Every group reads one block from one block of the same size, without DCP: the
    shape of most short requests, whose plan is a cached template moved to the blocks."""
    return blocks.block_ratio == 1 and not blocks.dcp and all(lids.size == 1 for lids, _ in blocks.ids)


@dataclass(frozen=True, slots=True)
class _ShiftedReads:
    """One remote rank's reads of block 0 from block 0, and per row what moves them to
    other blocks: a row of region x moves by block id of x's group times x's stride."""

    template: Reads
    local_group: np.ndarray
    local_stride: np.ndarray
    remote_group: np.ndarray
    remote_stride: np.ndarray


@dataclass(frozen=True, slots=True)
class _OneBlockTemplate:
    """A rank's plan when every group reads one block (see _one_block_each).

    Every offset of such a plan is linear in its group's block ids (attention, latent and
    SSM units are id * stride + a fixed part), and coalescing joins rows of one region,
    all of which move by the same amount: the plan of block 0 from block 0, moved, is the
    plan of any one block from any one block. tests/unit/test_planner_template.py checks
    it against the full planner.
    """

    reads: tuple[_ShiftedReads, ...]

    def shifted(self, blocks: RequestBlocks) -> tuple[Reads, ...]:
        lids = np.array([int(ids[0]) for ids, _ in blocks.ids], dtype=np.int64)
        rids = np.array([int(r[0]) for _, r in blocks.ids], dtype=np.int64)
        out = []
        for x in self.reads:
            t = x.template
            out.append(Reads(t.remote_rank, t.local_region, t.local_offset + lids[x.local_group] * x.local_stride,
                             t.remote_region, t.remote_offset + rids[x.remote_group] * x.remote_stride, t.length))
        return tuple(out)


@functools.lru_cache(maxsize=1024)
def _one_block_template(local: Side, remote: Side, local_rank: int) -> _OneBlockTemplate:
    """Cached like _rank_work: the plan of block 0 of every group from block 0."""
    ngroups = len(local.layout.groups)
    zero = np.zeros(1, dtype=np.int64)
    blocks = RequestBlocks(tuple((zero, zero) for _ in range(ngroups)), (0,) * ngroups, 1)
    reads = _plan_reads(local, remote, local_rank, _rank_work(local, remote, local_rank), blocks)

    def per_region(pool: PoolLayout) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([r.group_index for r in pool.regions], dtype=np.int64),
                np.array([r.block_stride for r in pool.regions], dtype=np.int64))

    lg, ls = per_region(local.pool)
    rg, rs = per_region(remote.pool)
    out = []
    for t in reads:
        for a in (t.local_region, t.local_offset, t.remote_region, t.remote_offset, t.length):
            a.flags.writeable = False  # shared by every plan made from it
        out.append(_ShiftedReads(t, lg[t.local_region], ls[t.local_region], rg[t.remote_region], rs[t.remote_region]))
    return _OneBlockTemplate(tuple(out))
