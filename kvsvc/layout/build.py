"""Build a per-rank EngineLayout from a model-level description (TOML tables, demo flags)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kvsvc.errors import InvalidArgument
from kvsvc.layout.engine import EngineLayout, KVCacheGroup, KvMemoryLayout, RegionLayout, per_rank_heads
from kvsvc.layout.kinds import BY_TABLE_KIND, KINDS, check_keys, table_int, table_list, table_str
from kvsvc.layout.specs import DType, KVCacheSpec, UniformTypeKVCacheSpecs
from kvsvc.reasons import Reason

GROUP_KINDS = (*BY_TABLE_KIND, "uniform")

# The keys each table may have beside its kind's (kinds.py): any other is named, not ignored.
LAYOUT_KEYS = frozenset({"model_id", "total_num_kv_heads", "block_size", "num_blocks", "dtype", "groups",
                         "kv_memory_layout", "region_layout", "dcp_size"})
_GROUP_EXTRA_KEYS = frozenset({"name", "num_layers", "num_blocks"})  # a group's own, beside its kind's
_UNIFORM_KEYS = frozenset({"name", "kind", "layers", "num_blocks"})
_ANY_LEAF_KEYS = frozenset().union(*(p.table_keys for p in KINDS))


def _leaf_spec(d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType, where: str,
               extra: frozenset[str] = frozenset()) -> KVCacheSpec:
    kind = table_str(d, "kind", "full_attention", where)
    policy = BY_TABLE_KIND.get(kind)
    if policy is not None:
        check_keys(d, policy.table_keys | extra, where)
    dt = DType.parse(table_str(d, "dtype", "", where)) if "dtype" in d else dtype
    if policy is None:
        raise InvalidArgument(Reason.UNKNOWN_SPEC_TYPE, f"unknown group kind {kind!r}; use one of {GROUP_KINDS}",
                              {"kind": kind})
    return policy.from_table(d, heads=heads, tp_size=tp_size, block=block, dtype=dt, where=where)


E = TypeVar("E", bound=enum.Enum)


def _choice(kind: type[E], value: str, field: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{field} is {value!r}; use one of "
                              f"{[m.value for m in kind]}", {"field": field, "value": value[:64]}) from None


def layout_from_dict(d: Mapping[str, Any], tp_size: int) -> EngineLayout:
    """Per-rank layout for TP size tp_size from a model-level table (see README, Config).

    Groups give kind, num_layers and head sizes of the whole model; per-rank head counts
    and sharded Mamba state shapes follow from total_num_kv_heads and tp_size.
    """
    if tp_size <= 0:
        raise InvalidArgument(Reason.INVALID_TP_SIZE, f"tp_size must be positive, got {tp_size}", {"tp_size": tp_size})
    check_keys(d, LAYOUT_KEYS, "layout")
    k = table_int(d, "total_num_kv_heads", 8, "layout")
    block = table_int(d, "block_size", 16, "layout")
    dtype = DType.parse(table_str(d, "dtype", "bfloat16", "layout"))
    heads = per_rank_heads(k, tp_size)
    groups: list[KVCacheGroup] = []
    layer_no = 0
    for gi, g in enumerate(table_list(d, "groups", [{"kind": "full_attention", "num_layers": 2}], "layout")):
        where = f"layout.groups[{gi}]"
        check_keys(g, _UNIFORM_KEYS | _GROUP_EXTRA_KEYS | _ANY_LEAF_KEYS, where)
        name = table_str(g, "name", f"g{gi}", where)
        if g.get("kind") == "uniform":
            check_keys(g, _UNIFORM_KEYS, where)
            inner: list[tuple[str, KVCacheSpec]] = []
            for li, ld in enumerate(table_list(g, "layers", [], where)):
                inner.append((f"layers.{layer_no}", _leaf_spec(ld, heads=heads, tp_size=tp_size, block=block,
                                                               dtype=dtype, where=f"{where}.layers[{li}]")))
                layer_no += 1
            groups.append(KVCacheGroup(name, UniformTypeKVCacheSpecs(block, tuple(inner)),
                                       num_blocks=table_int(g, "num_blocks", 0, where)))
            continue
        spec = _leaf_spec(g, heads=heads, tp_size=tp_size, block=block, dtype=dtype, where=where,
                          extra=_GROUP_EXTRA_KEYS)
        n = table_int(g, "num_layers", 1, where)
        groups.append(KVCacheGroup(name, spec, tuple(f"layers.{layer_no + i}" for i in range(n)),
                                   table_int(g, "num_blocks", 0, where)))
        layer_no += n
    layout = EngineLayout(
        model_id=table_str(d, "model_id", "kvsvc-tiny", "layout"),
        total_num_kv_heads=k,
        block_size=block,
        num_blocks=table_int(d, "num_blocks", 64, "layout"),
        groups=tuple(groups),
        kv_memory_layout=_choice(KvMemoryLayout, table_str(d, "kv_memory_layout", "HND", "layout").upper(),
                                 "layout.kv_memory_layout"),
        region_layout=_choice(RegionLayout, table_str(d, "region_layout", "split_kv", "layout").lower(),
                              "layout.region_layout"),
        dcp_size=table_int(d, "dcp_size", 1, "layout"),
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
