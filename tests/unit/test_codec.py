"""Layout <-> protobuf round trips and the rejection of unset enums."""

from __future__ import annotations

import pytest

from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.errors import InvalidArgument
from kvsvc.layout import layout_from_dict, simple_layout
from kvsvc.v1 import kv_transfer_pb2 as pb


@pytest.mark.parametrize("layout", [
    simple_layout(tp_size=2),
    simple_layout(tp_size=1, mla=True, head_size=576, region_layout="blocks_first"),
    simple_layout(tp_size=4, kv_memory_layout="NHD",
                  extra_groups=[{"name": "ssm", "kind": "mamba", "states": [{"shape": [8, 4]}, {"shape": [4]}]},
                                {"name": "swa", "kind": "sliding_window", "num_layers": 2, "sliding_window": 64}]),
    layout_from_dict({"model_id": "dsv4-like", "groups": [{"kind": "uniform", "layers": [
        {"kind": "mla", "head_size": 576}, {"kind": "mla", "head_size": 128}]}]}, 2),
])
def test_round_trip(layout):
    msg = layout_to_proto(layout)
    assert layout_from_proto(pb.KvLayout.FromString(msg.SerializeToString())) == layout


def test_unspecified_enum_rejected():
    msg = layout_to_proto(simple_layout(tp_size=1))
    msg.kv_memory_layout = pb.KV_MEMORY_LAYOUT_UNSPECIFIED
    with pytest.raises(InvalidArgument) as e:
        layout_from_proto(msg)
    assert e.value.reason == "UNSPECIFIED_ENUM"
    assert e.value.field_violations[0].field == "layout.kv_memory_layout"


def test_unspecified_dtype_rejected():
    msg = layout_to_proto(simple_layout(tp_size=1))
    msg.groups[0].spec.full_attention.dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(InvalidArgument) as e:
        layout_from_proto(msg)
    assert e.value.reason == "UNSPECIFIED_ENUM"


def test_missing_spec_kind_rejected():
    msg = layout_to_proto(simple_layout(tp_size=1))
    msg.groups[0].ClearField("spec")
    with pytest.raises(InvalidArgument) as e:
        layout_from_proto(msg)
    assert e.value.reason == "MISSING_FIELD"


def test_layout_sizes_are_bounded_before_anything_is_built():
    base = layout_to_proto(simple_layout(tp_size=1))
    for mutate, field in (
        (lambda m: setattr(m, "num_blocks", 1 << 30), "layout.num_blocks"),
        (lambda m: setattr(m, "total_num_kv_heads", 1 << 20), "layout.total_num_kv_heads"),
        (lambda m: m.groups.extend([m.groups[0]] * 100), "layout.groups"),
        (lambda m: setattr(m.groups[0].spec.full_attention, "head_size", 1 << 30), "layout.groups[0].spec.head_size"),
        (lambda m: setattr(m, "model_id", "m" * 1000), "layout.model_id"),
    ):
        msg = type(base)()
        msg.CopyFrom(base)
        mutate(msg)
        with pytest.raises(InvalidArgument) as e:
            layout_from_proto(msg, "layout", 1)
        assert (e.value.reason, e.value.metadata["field"]) == ("FIELD_TOO_LARGE", field)


@pytest.mark.parametrize("spec, field", [
    (pb.KvCacheSpec(full_attention=pb.FullAttentionSpec(head_size=70_000, num_kv_heads_per_rank=1,
                                                        dtype=pb.DTYPE_FLOAT16)), "g.head_size"),
    (pb.KvCacheSpec(mla_attention=pb.MlaAttentionSpec(head_size=1 << 20, dtype=pb.DTYPE_FLOAT16)), "g.head_size"),
    (pb.KvCacheSpec(mamba=pb.MambaSpec(states=[pb.MambaStateSpec(shape=[2], dtype=pb.DTYPE_FLOAT16)] * 17)),
     "g.states"),
    (pb.KvCacheSpec(mamba=pb.MambaSpec(states=[pb.MambaStateSpec(shape=[2] * 9, dtype=pb.DTYPE_FLOAT16)])),
     "g.states[0].shape"),
    (pb.KvCacheSpec(mamba=pb.MambaSpec(states=[pb.MambaStateSpec(shape=[2, 70_000], dtype=pb.DTYPE_FLOAT16)])),
     "g.states[0].shape"),
])
def test_a_kind_message_past_its_limits_is_refused_naming_the_field(spec, field):
    """The limits hold for every kind's message (the codec checks them without knowing kinds)."""
    from kvsvc.codec import spec_from_proto

    with pytest.raises(InvalidArgument) as e:
        spec_from_proto(spec, 16, "g")
    assert (e.value.reason, e.value.metadata["field"]) == ("FIELD_TOO_LARGE", field), e.value


def test_a_sliding_window_longer_than_a_dimension_is_not_a_dimension():
    from kvsvc.codec import spec_from_proto

    spec = spec_from_proto(pb.KvCacheSpec(sliding_window=pb.SlidingWindowSpec(
        num_kv_heads_per_rank=1, head_size=8, dtype=pb.DTYPE_FLOAT16, sliding_window_tokens=1 << 20)), 16, "g")
    assert spec.sliding_window == 1 << 20
