"""Build a per-rank EngineLayout from a model-level description (TOML tables, demo flags)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.layout.engine import EngineLayout, KVCacheGroup, KvMemoryLayout, RegionLayout, per_rank_heads
from kvsvc.layout.specs import (
    DType,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvsvc.reasons import Reason

GROUP_KINDS = ("full_attention", "sliding_window", "mla", "mamba", "uniform")

# The keys each table may have: any other is a mistake to name, not to ignore (a misspelt
# `num_block = 4096` used to give the default 64 blocks without a word).
LAYOUT_KEYS = frozenset({"model_id", "total_num_kv_heads", "block_size", "num_blocks", "dtype", "groups",
                         "kv_memory_layout", "region_layout", "dcp_size"})
_LEAF_KEYS = {
    "full_attention": frozenset({"kind", "dtype", "head_size", "head_size_v"}),
    "sliding_window": frozenset({"kind", "dtype", "head_size", "sliding_window"}),
    "mla": frozenset({"kind", "dtype", "head_size"}),
    "mamba": frozenset({"kind", "dtype", "states"}),
}
_GROUP_EXTRA_KEYS = frozenset({"name", "num_layers"})  # a group's own, beside its kind's
_UNIFORM_KEYS = frozenset({"name", "kind", "layers"})
_STATE_KEYS = frozenset({"shape", "dtype"})


def _check_keys(table: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(table, Mapping):
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{where} must be a table, not {type(table).__name__}",
                              {"where": where})
    unknown = sorted(str(k) for k in table if k not in allowed)
    if unknown:
        raise InvalidArgument(Reason.UNKNOWN_LAYOUT_KEY, f"{where} has unknown keys {unknown}; it may have "
                              f"{sorted(allowed)}", {"where": where, "unknown": ",".join(unknown)})


def _leaf_spec(d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType, where: str,
               extra: frozenset[str] = frozenset()) -> KVCacheSpec:
    kind = d.get("kind", "full_attention")
    if kind in _LEAF_KEYS:
        _check_keys(d, _LEAF_KEYS[kind] | extra, where)
    dt = DType.parse(d["dtype"]) if "dtype" in d else dtype
    if kind == "full_attention":
        return FullAttentionSpec(block, heads, int(d.get("head_size", 64)), dt, int(d.get("head_size_v", 0)))
    if kind == "sliding_window":
        return SlidingWindowSpec(block, heads, int(d.get("head_size", 64)), dt, int(d.get("sliding_window", 128)))
    if kind == "mla":
        return MLAAttentionSpec(block, 1, int(d.get("head_size", 576)), dt)
    if kind == "mamba":
        states = d.get("states", [{"shape": [8, 16]}])
        shapes = []
        for si, st in enumerate(states):
            _check_keys(st, _STATE_KEYS, f"{where}.states[{si}]")
            full = [int(x) for x in st["shape"]]
            if full[0] % tp_size:
                raise InvalidArgument(
                    Reason.TP_NOT_DIVISIBLE,
                    f"mamba state dim 0 ({full[0]}) is not divisible by TP {tp_size}",
                    {"state_dim0": full[0], "tp_size": tp_size},
                )
            shapes.append((full[0] // tp_size, *full[1:]))
        dtypes = tuple(DType.parse(st["dtype"]) if "dtype" in st else dt for st in states)
        return MambaSpec(block, tuple(shapes), dtypes)
    raise InvalidArgument(Reason.UNKNOWN_SPEC_TYPE, f"unknown group kind {kind!r}; use one of {GROUP_KINDS}", {"kind": kind})


def layout_from_dict(d: Mapping[str, Any], tp_size: int) -> EngineLayout:
    """Per-rank layout for TP size tp_size from a model-level table (see README, Config).

    Groups give kind, num_layers and head sizes of the whole model; per-rank head counts
    and sharded Mamba state shapes follow from total_num_kv_heads and tp_size.
    """
    if tp_size <= 0:
        raise InvalidArgument(Reason.INVALID_TP_SIZE, f"tp_size must be positive, got {tp_size}", {"tp_size": tp_size})
    _check_keys(d, LAYOUT_KEYS, "layout")
    k = int(d.get("total_num_kv_heads", 8))
    block = int(d.get("block_size", 16))
    dtype = DType.parse(str(d.get("dtype", "bfloat16")))
    heads = per_rank_heads(k, tp_size)
    groups: list[KVCacheGroup] = []
    layer_no = 0
    for gi, g in enumerate(d.get("groups", [{"kind": "full_attention", "num_layers": 2}])):
        where = f"layout.groups[{gi}]"
        _check_keys(g, _UNIFORM_KEYS | _GROUP_EXTRA_KEYS | frozenset().union(*_LEAF_KEYS.values()), where)
        name = str(g.get("name", f"g{gi}"))
        if g.get("kind") == "uniform":
            _check_keys(g, _UNIFORM_KEYS, where)
            inner: list[tuple[str, KVCacheSpec]] = []
            for li, ld in enumerate(g.get("layers", [])):
                inner.append((f"layers.{layer_no}", _leaf_spec(ld, heads=heads, tp_size=tp_size, block=block,
                                                               dtype=dtype, where=f"{where}.layers[{li}]")))
                layer_no += 1
            groups.append(KVCacheGroup(name, UniformTypeKVCacheSpecs(block, tuple(inner))))
            continue
        spec = _leaf_spec(g, heads=heads, tp_size=tp_size, block=block, dtype=dtype, where=where,
                          extra=_GROUP_EXTRA_KEYS)
        n = int(g.get("num_layers", 1))
        groups.append(KVCacheGroup(name, spec, tuple(f"layers.{layer_no + i}" for i in range(n))))
        layer_no += n
    layout = EngineLayout(
        model_id=str(d.get("model_id", "kvsvc-tiny")),
        total_num_kv_heads=k,
        block_size=block,
        num_blocks=int(d.get("num_blocks", 64)),
        groups=tuple(groups),
        kv_memory_layout=KvMemoryLayout(str(d.get("kv_memory_layout", "HND")).upper()),
        region_layout=RegionLayout(str(d.get("region_layout", "split_kv")).lower()),
        dcp_size=int(d.get("dcp_size", 1)),
    )
    layout.validate(tp_size)
    return layout


def simple_layout(
    *,
    tp_size: int,
    kv_heads: int = 8,
    num_layers: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    num_blocks: int = 64,
    mla: bool = False,
    dtype: str = "bfloat16",
    model_id: str = "kvsvc-tiny",
    extra_groups: Sequence[Mapping[str, Any]] = (),
    kv_memory_layout: str = "HND",
    region_layout: str = "split_kv",
    dcp_size: int = 1,
) -> EngineLayout:
    """A one-group GQA or MLA layout (plus extra groups): the demo's and tests' shorthand."""
    main = {"name": "mla" if mla else "full", "kind": "mla" if mla else "full_attention",
            "num_layers": num_layers, "head_size": head_size}
    return layout_from_dict(
        {
            "model_id": model_id, "total_num_kv_heads": kv_heads, "block_size": block_size,
            "num_blocks": num_blocks, "dtype": dtype, "groups": [main, *extra_groups],
            "kv_memory_layout": kv_memory_layout, "region_layout": region_layout, "dcp_size": dcp_size,
        },
        tp_size,
    )
