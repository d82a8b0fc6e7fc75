"""Spec arithmetic, representative types, validation and compatibility rules (MAPPING.md §1, §6)."""

from __future__ import annotations

import pytest

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.layout import (
    DType,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecFamily,
    UniformTypeKVCacheSpecs,
    build_pool_layout,
    check_compatibility,
    compatibility_hash,
    layout_from_dict,
    representative_spec_type,
    simple_layout,
    spec_family,
)

BF16 = DType.BFLOAT16


def test_page_sizes():
    assert FullAttentionSpec(16, 4, 128, BF16).page_size_bytes() == 2 * 16 * 4 * 128 * 2
    assert FullAttentionSpec(16, 4, 128, BF16, head_size_v=64).page_size_bytes() == 16 * 4 * (128 + 64) * 2
    assert MLAAttentionSpec(64, 1, 576, BF16).page_size_bytes() == 64 * 576 * 2
    assert SlidingWindowSpec(16, 2, 64, DType.FLOAT32, 128).page_size_bytes() == 2 * 16 * 2 * 64 * 4
    assert MambaSpec(16, ((4, 8), (3,)), (DType.FLOAT32, BF16)).page_size_bytes() == 4 * 8 * 4 + 3 * 2
    uni = UniformTypeKVCacheSpecs(64, (("a", MLAAttentionSpec(64, 1, 576, BF16)), ("b", MLAAttentionSpec(64, 1, 128, BF16))))
    assert uni.page_size_bytes() == 64 * 576 * 2 + 64 * 128 * 2


def test_representative_type_and_family():
    uni = UniformTypeKVCacheSpecs(16, (("a", MLAAttentionSpec(16, 1, 576, BF16)), ("b", MLAAttentionSpec(16, 1, 64, BF16))))
    assert representative_spec_type(uni) is MLAAttentionSpec
    assert spec_family(uni) is SpecFamily.MLA
    assert representative_spec_type(FullAttentionSpec(16, 1, 8, BF16)) is FullAttentionSpec


def test_mixed_family_wrapper_rejected():
    # The representative (first) type says MLA; the second layer is not: look at every inner spec.
    mixed = UniformTypeKVCacheSpecs(16, (("a", MLAAttentionSpec(16, 1, 576, BF16)), ("b", FullAttentionSpec(16, 2, 64, BF16))))
    with pytest.raises(FailedPrecondition) as e:
        spec_family(mixed)
    assert e.value.reason == "MIXED_FAMILY_GROUP"


def test_layout_validation_lists_every_field():
    with pytest.raises(InvalidArgument) as e:
        layout_from_dict({"num_blocks": 0, "groups": [{"kind": "full_attention", "num_layers": 1, "head_size": 0}]}, 1)
    fields = {v.field for v in e.value.field_violations}
    assert "layout.num_blocks" in fields and "layout.groups[0].layers[0].head_size" in fields


def test_regions_split_and_blocks_first():
    split = build_pool_layout(simple_layout(tp_size=1, num_layers=2, kv_heads=2, head_size=4, block_size=2, num_blocks=3))
    assert [r.kind.value for r in split.regions] == ["key", "value", "key", "value"]
    assert all(r.block_stride == r.block_len for r in split.regions)
    bf = build_pool_layout(simple_layout(tp_size=1, num_layers=1, kv_heads=2, head_size=4, block_size=2, num_blocks=3,
                                         region_layout="blocks_first"))
    k, v = bf.regions
    assert k.block_stride == v.block_stride == 2 * k.block_len
    assert v.pool_offset == k.pool_offset + k.block_len
    assert bf.size_bytes >= k.pool_offset + k.extent + k.block_len


def reasons(local, lt, remote, rt):
    return {v.reason for v in check_compatibility(local, lt, remote, rt)}


def test_compatible_pairs():
    for lt, rt, k in [(1, 2, 8), (16, 8, 8), (8, 4, 4), (2, 4, 2), (4, 1, 2)]:
        assert reasons(simple_layout(tp_size=lt, kv_heads=k), lt, simple_layout(tp_size=rt, kv_heads=k), rt) == set()


def test_any_memory_orders_pair_at_any_tp():
    """NHD blocks split by heads (a token row at a time, SGLang's pages of many tokens) and an
    NHD engine paired with an HND one: no refusal (tests/unit/test_geometry.py moves their bytes)."""
    for block in (1, 2, 16):
        nhd = {"kv_memory_layout": "NHD", "block_size": block}
        assert reasons(simple_layout(tp_size=1, **nhd), 1, simple_layout(tp_size=2, **nhd), 2) == set()
        assert reasons(simple_layout(tp_size=2, **nhd), 2, simple_layout(tp_size=1, block_size=block), 1) == set()
        assert reasons(simple_layout(tp_size=4, **nhd), 4, simple_layout(tp_size=4, block_size=block), 4) == set()


def test_gqa_replication_beyond_k_is_accepted():
    # The reference rejects K=8, P TP 8 -> D TP 16 because it scales block length by TP.
    assert reasons(simple_layout(tp_size=16, kv_heads=8), 16, simple_layout(tp_size=8, kv_heads=8), 8) == set()


@pytest.mark.parametrize(("local_kw", "lt", "remote_kw", "rt", "reason"), [
    ({}, 3, {}, 2, "TP_NOT_DIVISIBLE"),
    ({"block_size": 16}, 1, {"block_size": 32}, 1, "BLOCK_SIZE_MISMATCH"),
    ({"block_size": 24}, 1, {"block_size": 16}, 1, "BLOCK_SIZE_MISMATCH"),
    ({"dtype": "float16"}, 1, {}, 1, "DTYPE_MISMATCH"),
    ({"head_size": 128}, 1, {"head_size": 64}, 1, "HEAD_SIZE_MISMATCH"),
    ({"num_layers": 3}, 1, {"num_layers": 2}, 1, "LAYER_COUNT_MISMATCH"),
    ({"model_id": "a"}, 1, {"model_id": "b"}, 1, "MODEL_MISMATCH"),
    ({"kv_heads": 4}, 1, {"kv_heads": 8}, 1, "KV_HEADS_MISMATCH"),
    ({"mla": True}, 1, {}, 1, "GROUP_MISMATCH"),
])
def test_refusals(local_kw, lt, remote_kw, rt, reason):
    local = simple_layout(tp_size=lt if lt != 3 else 1, **local_kw)
    remote = simple_layout(tp_size=rt, **remote_kw)
    assert reason in reasons(local, lt, remote, rt)


def test_every_violation_is_reported():
    got = reasons(simple_layout(tp_size=1, dtype="float16", head_size=128, model_id="a"), 1,
                  simple_layout(tp_size=1, model_id="b"), 1)
    assert {"MODEL_MISMATCH", "DTYPE_MISMATCH", "HEAD_SIZE_MISMATCH"} <= got


def test_hash_is_tp_and_block_invariant():
    a = compatibility_hash(simple_layout(tp_size=1, block_size=16, num_blocks=10))
    assert a == compatibility_hash(simple_layout(tp_size=4, block_size=32, num_blocks=99))
    assert a != compatibility_hash(simple_layout(tp_size=1, head_size=128))
    assert a != compatibility_hash(simple_layout(tp_size=1, model_id="other"))


@pytest.mark.parametrize(("k", "tp"), [(6, 4), (8, 3), (2, 3), (4, 6)])
def test_kv_heads_must_shard_over_tp(k, tp):
    with pytest.raises(InvalidArgument) as e:
        simple_layout(tp_size=tp, kv_heads=k)
    assert any(v.field == "layout.total_num_kv_heads" for v in e.value.field_violations)


@pytest.mark.parametrize(("k", "tp"), [(8, 16), (1, 8), (6, 3), (4, 4)])
def test_kv_heads_shard_or_replicate(k, tp):
    assert simple_layout(tp_size=tp, kv_heads=k).validate(tp) is None


@pytest.mark.parametrize("table, where, unknown", [
    ({"num_block": 4096}, "layout", "num_block"),  # misspelt: it used to give the default 64 blocks
    ({"groups": [{"kind": "full_attention", "head_sise": 128}]}, "layout.groups[0]", "head_sise"),
    ({"groups": [{"kind": "mla", "sliding_window": 8}]}, "layout.groups[0]", "sliding_window"),
    ({"groups": [{"kind": "uniform", "num_layers": 2, "layers": []}]}, "layout.groups[0]", "num_layers"),
    ({"groups": [{"kind": "uniform", "layers": [{"kind": "mla", "num_layers": 3}]}]}, "layout.groups[0].layers[0]",
     "num_layers"),
    ({"groups": [{"kind": "mamba", "states": [{"shape": [8], "shap": [4]}]}]}, "layout.groups[0].states[0]", "shap"),
])
def test_unknown_layout_keys_are_named_not_ignored(table, where, unknown):
    with pytest.raises(InvalidArgument) as e:
        layout_from_dict(table, 1)
    assert e.value.reason == "UNKNOWN_LAYOUT_KEY"
    assert e.value.metadata == {"where": where, "unknown": unknown}


@pytest.mark.parametrize("table, field", [
    ({"num_blocks": 4.7}, "layout.num_blocks"),  # it loaded 4 blocks, unsaid
    ({"block_size": True}, "layout.block_size"),  # it loaded a block of 1 token
    ({"total_num_kv_heads": "8"}, "layout.total_num_kv_heads"),
    ({"dcp_size": 2.0}, "layout.dcp_size"),
    ({"model_id": 7}, "layout.model_id"),
    ({"dtype": 16}, "layout.dtype"),
    ({"kv_memory_layout": "XHD"}, "layout.kv_memory_layout"),
    ({"region_layout": "by_layer"}, "layout.region_layout"),
    ({"groups": {"full": {}}}, "layout.groups"),
    ({"groups": [{"kind": "full_attention", "num_layers": "3"}]}, "layout.groups[0].num_layers"),
    ({"groups": [{"kind": "full_attention", "head_size": 64.5}]}, "layout.groups[0].head_size"),
    ({"groups": [{"kind": "sliding_window", "sliding_window": False}]}, "layout.groups[0].sliding_window"),
    ({"groups": [{"kind": "mla", "num_blocks": 1e3}]}, "layout.groups[0].num_blocks"),
    ({"groups": [{"kind": 3}]}, "layout.groups[0].kind"),
    ({"groups": [{"kind": "uniform", "layers": {"kind": "mla"}}]}, "layout.groups[0].layers"),
    ({"groups": [{"kind": "mamba", "states": [{"shape": [8, 1.5]}]}]}, "layout.groups[0].states[0].shape"),
])
def test_layout_values_of_the_wrong_type_are_refused_not_converted(table, field):
    with pytest.raises(InvalidArgument) as e:
        layout_from_dict(table, 1)
    assert (e.value.reason, e.value.metadata["field"]) == ("INVALID_LAYOUT", field), e.value


def test_integers_of_any_integer_type_are_taken():
    """An engine's sizes may be numpy integers; they are whole numbers all the same."""
    import numpy as np

    layout = layout_from_dict({"num_blocks": np.int64(12), "block_size": np.int32(4),
                               "groups": [{"kind": "mamba", "states": [{"shape": [np.int64(8), 16]}]}]}, 1)
    assert (layout.num_blocks, layout.block_size) == (12, 4) and type(layout.num_blocks) is int


def test_a_group_may_have_a_pool_of_its_own_size():
    """SGLang's sliding-window pool holds fewer pages than its full pool: the group's regions
    get its block count, and its block ids are checked against it (not the layout's)."""
    from kvsvc.codec import layout_from_proto, layout_to_proto
    from kvsvc.errors import InvalidArgument
    from kvsvc.layout.regions import build_pool_layout
    from kvsvc.mapping import Side, plan_rank

    swa = {"name": "swa", "kind": "sliding_window", "num_layers": 1, "head_size": 4, "sliding_window": 8,
           "num_blocks": 6}
    lay = simple_layout(tp_size=1, num_blocks=32, extra_groups=[swa])
    assert [lay.group_blocks(g) for g in range(2)] == [32, 6]
    assert {r.group_index: r.num_blocks for r in build_pool_layout(lay).regions} == {0: 32, 1: 6}
    assert layout_from_proto(layout_to_proto(lay), tp_size=1) == lay
    side = Side.of(lay, 1)
    plan_rank(side, side, 0, [[31], [5]], [[30], [4]])
    with pytest.raises(InvalidArgument) as e:
        plan_rank(side, side, 0, [[31], [6]], [[30], [4]])
    assert e.value.reason == "BLOCK_OUT_OF_RANGE" and e.value.metadata["num_blocks"] == "6"
    with pytest.raises(InvalidArgument) as e:
        simple_layout(tp_size=1, extra_groups=[{**swa, "num_blocks": -1}])
    assert "num_blocks" in str(e.value)
