"""Typed pool views alias the pool with the right geometry, in numpy and in torch (what VRAM pools use)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsvc.client.attach import typed_view
from kvsvc.codec import layout_to_proto, region_to_proto
from kvsvc.layout import build_pool_layout, simple_layout

SSM = {"name": "ssm", "kind": "mamba", "states": [{"shape": [4, 3]}, {"shape": [2]}]}


def pool_for(**kw):
    layout = simple_layout(tp_size=1, kv_heads=2, head_size=4, block_size=2, num_blocks=3, dtype="float32",
                           num_layers=1, **kw)
    pool = build_pool_layout(layout)
    return layout_to_proto(layout), [region_to_proto(r) for r in pool.regions], pool.size_bytes


@pytest.mark.parametrize("region_layout", ["split_kv", "blocks_first"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_views_alias_the_pool(region_layout, backend):
    layout, regions, size = pool_for(region_layout=region_layout, extra_groups=[SSM])
    buf = np.zeros(size, np.uint8)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        buf = torch.zeros(size, dtype=torch.uint8)
    k, v = typed_view(buf, regions[0], layout, regions), typed_view(buf, regions[1], layout, regions)
    assert tuple(k.shape) == (3, 2, 2, 4)  # blocks, heads, tokens, head_size (HND)
    k[1, 1, 0, 2] = 7.0
    v[2, 0, 1, 3] = 9.0
    flat = np.asarray(buf).view(np.float32) if backend == "numpy" else buf.numpy().view(np.float32)
    r0, r1 = regions[0], regions[1]
    # Element (block b, head h, token t, dim d) sits at b*stride + ((h*T + t)*D + d)*4 from the region start.
    assert flat[(r0.pool_offset_bytes + 1 * r0.block_stride_bytes + ((1 * 2 + 0) * 4 + 2) * 4) // 4] == 7.0
    assert flat[(r1.pool_offset_bytes + 2 * r1.block_stride_bytes + ((0 * 2 + 1) * 4 + 3) * 4) // 4] == 9.0
    assert np.count_nonzero(flat) == 2
    conv, state = typed_view(buf, regions[2], layout, regions), typed_view(buf, regions[3], layout, regions)
    assert tuple(conv.shape) == (3, 4, 3) and tuple(state.shape) == (3, 2)
