"""Engine-owned memory as engines hold it: one tensor per layer, K and V packed per token in each head.

vLLM's CPU attention keeps a layer as [num_blocks, heads, block_size, 2 * head_size]. The
servers here are embedded (create_server in this process) and handed those per-layer
tensors as they are, region by region: no copy, no kvsvc pool. P holds torch tensors
(two ranks in one server), D numpy arrays; NIXL reads between them and D is checked
byte for byte against kvsvc.verify.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsvc.client import AsyncClient
from kvsvc.config import Role, load_config
from kvsvc.errors import InvalidArgument
from kvsvc.layout import build_pool_layout, layout_from_dict
from kvsvc.service.server import create_server
from kvsvc.verify import RankMemory, check_rank, fill_rank
from tests.e2e.harness import ReleaseWatch, layout_table

K, HEAD, BLOCK, NB, LAYERS = 4, 4, 4, 16, 2


def table() -> dict:
    return layout_table(k=K, head=HEAD, block=BLOCK, nb=NB, layers=LAYERS, region_layout="packed_kv")


def layer_tensors(tp: int) -> list:
    """One engine rank's cache as vLLM's CPU backend allocates it: a tensor per layer."""
    heads = max(1, K // tp)
    return [torch.zeros(NB, heads, BLOCK, 2 * HEAD, dtype=torch.float32) for _ in range(LAYERS)]


def as_bytes(t) -> np.ndarray:
    arr = t.numpy() if hasattr(t, "numpy") else t
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2)])
async def test_per_layer_tensors_are_read_in_place(p_tp, d_tp):
    p_kv = {r: layer_tensors(p_tp) for r in range(p_tp)}
    d_kv = {r: [t.numpy() for t in layer_tensors(d_tp)] for r in range(d_tp)}
    p_srv, p_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="em-p", role=Role.PREFILL,
                                                    tp_size=p_tp, layout_table=table()), external_pools=p_kv)
    d_srv, d_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="em-d", role=Role.DECODE,
                                                    tp_size=d_tp, layout_table=table()), external_pools=d_kv)
    try:
        async with AsyncClient(f"127.0.0.1:{p_port}") as pc, AsyncClient(f"127.0.0.1:{d_port}") as dc:
            p_regions = build_pool_layout(layout_from_dict(table(), p_tp)).regions
            d_regions = build_pool_layout(layout_from_dict(table(), d_tp)).regions
            for r, tensors in p_kv.items():
                fill_rank(RankMemory(p_regions, None, [as_bytes(t) for t in tensors]), r, p_tp, K, [[7, 8, 2]], BLOCK)
            info = await pc.get_info()
            # The regions the peer reads are the tensors themselves.
            for pool in info.pools:
                assert [reg.base_address for reg in pool.regions] == [t.data_ptr() for t in p_kv[pool.tp_rank]]
            watch = await ReleaseWatch.open(pc)
            pub = await pc.publish_blocks("em-1", [[7, 8, 2]])
            await dc.transfer("d-em-1", pub.params, [[1, 3, 5]])
            for r, arrays in d_kv.items():
                errs = check_rank(RankMemory(d_regions, None, [as_bytes(a) for a in arrays]), r, d_tp, K,
                                  [[1, 3, 5]], BLOCK)
                assert not errs, errs
            assert [e.reason for e in await watch.wait_for("em-1")] == [1]  # CONSUMED
            await watch.close()
    finally:
        await d_srv.stop(0)
        await p_srv.stop(0)


@pytest.mark.parametrize(("bad", "what"), [
    (lambda: [torch.zeros(NB, 2, BLOCK, 2 * HEAD)], "1 buffers for 2 regions"),
    (lambda: [torch.zeros(NB - 1, 2, BLOCK, 2 * HEAD)] * 2, "must hold 16 contiguous blocks"),
    (lambda: [torch.zeros(NB, 2, BLOCK, 4 * HEAD)[..., :2 * HEAD]] * 2, "must hold 16 contiguous blocks"),
])
async def test_region_buffers_that_do_not_fit_are_refused(bad, what):
    with pytest.raises(InvalidArgument) as e:
        srv, _ = await create_server(load_config(listen="127.0.0.1:0", engine_id="em-bad", role=Role.DECODE,
                                                 tp_size=2, ranks=[0], layout_table=table()),
                                     external_pools={0: bad()})
        await srv.stop(0)
    assert e.value.reason == "POOL_MISMATCH" and what in e.value.message
