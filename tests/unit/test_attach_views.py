"""Typed pool views alias the pool with the right geometry, in numpy and in torch (what VRAM pools use)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsvc.client.attach import typed_view
from kvsvc.codec import region_to_proto
from kvsvc.layout import build_pool_layout, layout_from_dict, simple_layout
from kvsvc.v1 import kv_transfer_pb2 as pb

SSM = {"name": "ssm", "kind": "mamba", "states": [{"shape": [4, 3]}, {"shape": [2]}]}


def pool_for(**kw):
    layout = simple_layout(tp_size=1, kv_heads=2, head_size=4, block_size=2, num_blocks=3, dtype="float32",
                           num_layers=1, **kw)
    pool = build_pool_layout(layout)
    return [region_to_proto(r) for r in pool.regions], pool.size_bytes


@pytest.mark.parametrize("region_layout", ["split_kv", "blocks_first"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_views_alias_the_pool(region_layout, backend):
    regions, size = pool_for(region_layout=region_layout, extra_groups=[SSM])
    buf = np.zeros(size, np.uint8)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        buf = torch.zeros(size, dtype=torch.uint8)
    k, v = typed_view(buf, regions[0]), typed_view(buf, regions[1])
    assert tuple(k.shape) == (3, 2, 2, 4)  # blocks, heads, tokens, head_size (HND)
    k[1, 1, 0, 2] = 7.0
    v[2, 0, 1, 3] = 9.0
    flat = np.asarray(buf).view(np.float32) if backend == "numpy" else buf.numpy().view(np.float32)
    r0, r1 = regions[0], regions[1]
    # Element (block b, head h, token t, dim d) sits at b*stride + ((h*T + t)*D + d)*4 from the region start.
    assert flat[(r0.pool_offset_bytes + 1 * r0.block_stride_bytes + ((1 * 2 + 0) * 4 + 2) * 4) // 4] == 7.0
    assert flat[(r1.pool_offset_bytes + 2 * r1.block_stride_bytes + ((0 * 2 + 1) * 4 + 3) * 4) // 4] == 9.0
    assert np.count_nonzero(flat) == 2
    conv, state = typed_view(buf, regions[2]), typed_view(buf, regions[3])
    assert tuple(conv.shape) == (3, 4, 3) and tuple(state.shape) == (3, 2)


@pytest.mark.parametrize("table, shapes", [
    # HND: heads x tokens x head size; V with its own head size.
    ({"kv_memory_layout": "HND", "groups": [{"kind": "full_attention", "head_size": 8, "head_size_v": 4}]},
     [((2, 4, 8), pb.DTYPE_BFLOAT16), ((2, 4, 4), pb.DTYPE_BFLOAT16)]),
    ({"kv_memory_layout": "NHD", "groups": [{"kind": "sliding_window", "head_size": 8}]},
     [((4, 2, 8), pb.DTYPE_BFLOAT16), ((4, 2, 8), pb.DTYPE_BFLOAT16)]),
    # packed_kv: K then V of each token inside each head.
    ({"region_layout": "packed_kv", "groups": [{"kind": "full_attention", "head_size": 8}]},
     [((2, 4, 16), pb.DTYPE_BFLOAT16)]),
    ({"groups": [{"kind": "mla", "head_size": 12, "dtype": "float16"}]}, [((4, 12), pb.DTYPE_FLOAT16)]),
    ({"groups": [{"kind": "mamba", "states": [{"shape": [6, 3]}, {"shape": [10], "dtype": "float32"}]}]},
     [((3, 3), pb.DTYPE_BFLOAT16), ((5,), pb.DTYPE_FLOAT32)]),  # dim 0 split over TP 2
])
def test_every_kind_of_region_says_its_block_shape_and_type(table, shapes):
    """What typed_view relies on, per kind, written out here from the layout's definitions."""
    base = {"total_num_kv_heads": 4, "block_size": 4, "num_blocks": 2, "dtype": "bfloat16", **table}
    regions = [region_to_proto(r) for r in build_pool_layout(layout_from_dict(base, tp_size=2)).regions]
    assert [(tuple(r.block_shape), r.dtype) for r in regions] == shapes


def test_a_region_without_a_block_shape_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="block_shape"):
        typed_view(np.zeros(64, np.uint8), pb.RegionInfo(region_index=3, num_blocks=1, block_len_bytes=8,
                                                         block_stride_bytes=8))
