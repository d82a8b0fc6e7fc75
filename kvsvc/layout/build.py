"""Build a per-rank EngineLayout from a model-level description (TOML tables, demo flags)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.layout.engine import EngineLayout, KVCacheGroup, KvMemoryLayout, RegionLayout, per_rank_heads
from kvsvc.layout.kinds import BY_TABLE_KIND, KINDS, check_keys
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
    kind = d.get("kind", "full_attention")
    policy = BY_TABLE_KIND.get(kind)
    if policy is not None:
        check_keys(d, policy.table_keys | extra, where)
    dt = DType.parse(d["dtype"]) if "dtype" in d else dtype
    if policy is None:
        raise InvalidArgument(Reason.UNKNOWN_SPEC_TYPE, f"unknown group kind {kind!r}; use one of {GROUP_KINDS}",
                              {"kind": kind})
    return policy.from_table(d, heads=heads, tp_size=tp_size, block=block, dtype=dt, where=where)


def layout_from_dict(d: Mapping[str, Any], tp_size: int) -> EngineLayout:
    """Per-rank layout for TP size tp_size from a model-level table (see README, Config).

    Groups give kind, num_layers and head sizes of the whole model; per-rank head counts
    and sharded Mamba state shapes follow from total_num_kv_heads and tp_size.
    """
    if tp_size <= 0:
        raise InvalidArgument(Reason.INVALID_TP_SIZE, f"tp_size must be positive, got {tp_size}", {"tp_size": tp_size})
    check_keys(d, LAYOUT_KEYS, "layout")
    k = int(d.get("total_num_kv_heads", 8))
    block = int(d.get("block_size", 16))
    dtype = DType.parse(str(d.get("dtype", "bfloat16")))
    heads = per_rank_heads(k, tp_size)
    groups: list[KVCacheGroup] = []
    layer_no = 0
    for gi, g in enumerate(d.get("groups", [{"kind": "full_attention", "num_layers": 2}])):
        where = f"layout.groups[{gi}]"
        check_keys(g, _UNIFORM_KEYS | _GROUP_EXTRA_KEYS | _ANY_LEAF_KEYS, where)
        name = str(g.get("name", f"g{gi}"))
        if g.get("kind") == "uniform":
            check_keys(g, _UNIFORM_KEYS, where)
            inner: list[tuple[str, KVCacheSpec]] = []
            for li, ld in enumerate(g.get("layers", [])):
                inner.append((f"layers.{layer_no}", _leaf_spec(ld, heads=heads, tp_size=tp_size, block=block,
                                                               dtype=dtype, where=f"{where}.layers[{li}]")))
                layer_no += 1
            groups.append(KVCacheGroup(name, UniformTypeKVCacheSpecs(block, tuple(inner)),
                                       num_blocks=int(g.get("num_blocks", 0))))
            continue
        spec = _leaf_spec(g, heads=heads, tp_size=tp_size, block=block, dtype=dtype, where=where,
                          extra=_GROUP_EXTRA_KEYS)
        n = int(g.get("num_layers", 1))
        groups.append(KVCacheGroup(name, spec, tuple(f"layers.{layer_no + i}" for i in range(n)),
                                   int(g.get("num_blocks", 0))))
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
