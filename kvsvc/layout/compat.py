"""Compatibility of two engines' layouts: every violated rule, and a TP-invariant hash."""

from __future__ import annotations

import hashlib
import json

from kvsvc.errors import KvsvcError
from kvsvc.layout.engine import EngineLayout, RegionLayout, per_rank_heads
from kvsvc.layout.kinds import policy_of, spec_family
from kvsvc.layout.regions import Region, RegionKind, build_pool_layout
from kvsvc.layout.specs import KVCacheSpec, SpecFamily
from kvsvc.layout.violation import Violation as Violation  # re-exported: what check_compatibility returns
from kvsvc.layout.violation import violation
from kvsvc.reasons import Reason

HASH_VERSION = 1


def tp_divisibility(local_tp: int, remote_tp: int) -> Violation | None:
    """The TP sizes must divide one another (MAPPING.md §2)."""
    if local_tp <= 0 or remote_tp <= 0 or (local_tp % remote_tp and remote_tp % local_tp):
        return violation(Reason.TP_NOT_DIVISIBLE,
                  f"TP sizes {local_tp} (local) and {remote_tp} (remote) must divide one another",
                  local_tp_size=local_tp, remote_tp_size=remote_tp)
    return None


def check_compatibility(
    local: EngineLayout, local_tp: int, remote: EngineLayout, remote_tp: int
) -> list[Violation]:
    """Every rule of MAPPING.md §6 that the pair (local reads from remote) breaks."""
    out: list[Violation] = []
    tp = tp_divisibility(local_tp, remote_tp)
    if tp:
        out.append(tp)
    if local.model_id != remote.model_id:
        out.append(violation(Reason.MODEL_MISMATCH, f"models differ: local {local.model_id!r}, remote {remote.model_id!r}",
                      local_model_id=local.model_id, remote_model_id=remote.model_id))
    for side, lay in (("local", local), ("remote", remote)):
        for g in lay.groups:
            try:
                spec_family(g.spec)
            except KvsvcError as e:
                out.append(violation(e.reason, f"{side} group {g.name!r}: {e.message}", side=side, group=g.name))
    if out and any(v.reason == Reason.MIXED_FAMILY_GROUP for v in out):
        return out
    out.extend(_check_groups(local, remote))
    if any(v.reason == Reason.GROUP_MISMATCH for v in out):
        return out
    out.extend(_check_dcp(local, remote))  # names unequal block sizes itself when DCP is on
    if local.dcp_size == remote.dcp_size == 1 and local.block_size % remote.block_size:
        out.append(violation(Reason.BLOCK_SIZE_MISMATCH,
                      f"local block size {local.block_size} must be a multiple of the remote {remote.block_size} "
                      "(a larger remote block is unsupported: give the prefill side a block size that divides the "
                      "decode side's; under vLLM that is the attention backend's kernel block)",
                      local_block_size=local.block_size, remote_block_size=remote.block_size))
    if local.total_num_kv_heads != remote.total_num_kv_heads and _has_family(local, SpecFamily.ATTENTION):
        out.append(violation(Reason.KV_HEADS_MISMATCH,
                      f"total KV heads differ: local {local.total_num_kv_heads}, remote {remote.total_num_kv_heads}",
                      local_total_num_kv_heads=local.total_num_kv_heads,
                      remote_total_num_kv_heads=remote.total_num_kv_heads))
    packed = {lay.region_layout is RegionLayout.PACKED_KV for lay in (local, remote)}
    if len(packed) > 1 and (_has_family(local, SpecFamily.ATTENTION)):
        out.append(violation(Reason.REGION_LAYOUT_MISMATCH,
                      f"K and V are packed per token on one side ({local.region_layout.value} locally, "
                      f"{remote.region_layout.value} remotely): a packed row cannot be split into separate K and V",
                      local_region_layout=local.region_layout.value, remote_region_layout=remote.region_layout.value))
    if tp is None and not out:
        out.extend(_check_regions(local, local_tp, remote, remote_tp))
    return out


def _check_dcp(local: EngineLayout, remote: EngineLayout) -> list[Violation]:
    """The DCP rules (MAPPING.md §9): sizes that divide one another, equal block sizes, and
    equal DCP sizes when SSM state travels too."""
    lc, rd = local.dcp_size, remote.dcp_size
    if lc == 1 and rd == 1:
        return []
    out = []
    if lc % rd and rd % lc:
        out.append(violation(Reason.DCP_NOT_DIVISIBLE, f"DCP sizes {lc} (local) and {rd} (remote) must divide one another",
                      local_dcp_size=lc, remote_dcp_size=rd))
    if local.block_size != remote.block_size:
        out.append(violation(Reason.BLOCK_SIZE_MISMATCH, f"with DCP ({lc} local, {rd} remote) the block sizes must be equal: "
                      f"local {local.block_size}, remote {remote.block_size}",
                      local_block_size=local.block_size, remote_block_size=remote.block_size))
    if lc != rd and _has_family(local, SpecFamily.SSM):
        out.append(violation(Reason.DCP_MISMATCH, f"an MLA+SSM pair needs equal DCP sizes, got {lc} (local) and {rd} (remote)",
                      local_dcp_size=lc, remote_dcp_size=rd))
    return out


def _has_family(layout: EngineLayout, fam: SpecFamily) -> bool:
    return any(g.family is fam for g in layout.groups)


def _check_groups(local: EngineLayout, remote: EngineLayout) -> list[Violation]:
    out: list[Violation] = []
    if len(local.groups) != len(remote.groups):
        return [violation(Reason.GROUP_MISMATCH, f"group counts differ: local {len(local.groups)}, remote {len(remote.groups)}",
                   local_groups=len(local.groups), remote_groups=len(remote.groups))]
    for gi, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        if lg.family is not rg.family or lg.spec_type is not rg.spec_type:
            out.append(violation(Reason.GROUP_MISMATCH,
                          f"group {gi} types differ: local {lg.spec_type.__name__}, remote {rg.spec_type.__name__}",
                          group_index=gi, local_type=lg.spec_type.__name__, remote_type=rg.spec_type.__name__))
            continue
        ll, rl = list(lg.layers()), list(rg.layers())
        if len(ll) != len(rl):
            out.append(violation(Reason.LAYER_COUNT_MISMATCH,
                          f"group {gi} ({lg.name}) layer counts differ: local {len(ll)}, remote {len(rl)}",
                          group_index=gi, local_layers=len(ll), remote_layers=len(rl)))
            continue
        for (ln, ls), (_, rs) in zip(ll, rl, strict=True):
            out.extend(_check_leaf(gi, ln, ls, rs))
    return out


def _check_leaf(gi: int, layer: str, ls: KVCacheSpec, rs: KVCacheSpec) -> list[Violation]:
    if type(ls) is not type(rs):
        return [violation(Reason.GROUP_MISMATCH, f"layer {layer} types differ: {type(ls).__name__} vs {type(rs).__name__}",
                   group_index=gi, layer=layer)]
    return policy_of(ls).compare(layer, ls, rs)


def _check_regions(local: EngineLayout, local_tp: int, remote: EngineLayout, remote_tp: int) -> list[Violation]:
    lr, rr = build_pool_layout(local).regions, build_pool_layout(remote).regions
    if len(lr) != len(rr):
        return [violation(Reason.REGION_COUNT_MISMATCH, f"region counts differ: local {len(lr)}, remote {len(rr)}",
                   local_regions=len(lr), remote_regions=len(rr))]
    n = local.block_size // remote.block_size
    out: list[Violation] = []
    for a, b in zip(lr, rr, strict=True):
        v = _check_region_pair(a, b, n, local, local_tp, remote_tp)
        if v:
            out.append(v)
    return out


def _check_region_pair(a: Region, b: Region, n: int, local: EngineLayout, lt: int, rt: int) -> Violation | None:
    if a.kind is not b.kind:
        return violation(Reason.REGION_MISMATCH, f"region {a.index} kinds differ: {a.kind.value} vs {b.kind.value}",
                  region=a.index)
    if a.kind is RegionKind.SSM_STATE:
        expect_local = b.block_len * rt // lt if rt >= lt else None
        ok = a.block_len == expect_local if expect_local is not None else b.block_len == a.block_len * lt // rt
        if not ok:
            return violation(Reason.SSM_SHAPE_MISMATCH, f"region {a.index} ({a.layer_name}) state bytes {a.block_len} (TP {lt}) "
                      f"do not shard from {b.block_len} (TP {rt})", region=a.index,
                      local_block_len=a.block_len, remote_block_len=b.block_len)
        return None
    if a.kind is RegionKind.LATENT:
        if a.block_len != n * b.block_len:
            return violation(Reason.BLOCK_LEN_MISMATCH, f"MLA region {a.index} ({a.layer_name}) block lengths {a.block_len} vs "
                      f"{b.block_len} (block ratio {n}) must match", region=a.index,
                      local_block_len=a.block_len, remote_block_len=b.block_len)
        return None
    # Compare per-rank head counts, not block lengths scaled by TP: the latter wrongly
    # rejects valid GQA replication where TP exceeds the KV head count.
    want_l = per_rank_heads(local.total_num_kv_heads, lt)
    want_r = per_rank_heads(local.total_num_kv_heads, rt)
    if (a.heads, b.heads) != (want_l, want_r) or a.head_bytes != b.head_bytes:
        return violation(Reason.KV_HEADS_MISMATCH, f"region {a.index} ({a.layer_name}) holds {a.heads} local / {b.heads} remote "
                  f"heads per rank; K={local.total_num_kv_heads} at TP {lt}/{rt} needs {want_l}/{want_r}",
                  region=a.index, local_heads=a.heads, remote_heads=b.heads)
    return None


def compatibility_hash(layout: EngineLayout) -> str:
    """Hex digest of what two compatible engines share whatever their TP and block size."""
    groups = []
    for g in layout.groups:
        layers = []
        for _name, spec in g.layers():
            item = {"type": type(spec).__name__, **policy_of(spec).hash_item(spec)}
            layers.append(item)
        groups.append({"type": g.spec_type.__name__, "layers": layers})
    doc = {"v": HASH_VERSION, "model": layout.model_id, "k": layout.total_num_kv_heads, "groups": groups}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
