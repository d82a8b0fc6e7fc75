"""Embedding mode: a decode server inside the engine's process, reading into memory the engine owns."""

from __future__ import annotations

import numpy as np

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.client.attach import attach_pool
from kvsvc.config import Role, load_config
from kvsvc.layout import build_pool_layout, layout_from_dict
from kvsvc.service.server import create_server
from kvsvc.verify import RankMemory, check_rank, fill_rank, tag
from tests.e2e.harness import layout_table


async def test_decode_into_engine_owned_buffer():
    table = layout_table(k=4, head=4, block=4, nb=16)
    pool_layout = build_pool_layout(layout_from_dict(table, 1))
    engine_kv = np.zeros(pool_layout.size_bytes, np.uint8)  # the engine's own KV memory
    p = start_server(engine_id="emb-p", role="prefill", tp_size=2, layout=table)
    running, port = await create_server(
        load_config(listen="127.0.0.1:0", engine_id="emb-d", role=Role.DECODE, tp_size=1, layout_table=table),
        external_pools={0: engine_kv})
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(f"127.0.0.1:{port}") as dc:
            pinfo = await pc.get_info()
            p_regions = build_pool_layout(layout_from_dict(table, 2)).regions
            for pool in pinfo.pools:
                ap = attach_pool(pool)
                fill_rank(RankMemory(p_regions, ap.buffer), pool.tp_rank, 2, 4, [[7, 8]], 4)
                # The typed view an engine uses: [blocks, heads, tokens, head_size] float32 (HND).
                k0 = ap.kv(pool.regions[0], pinfo.layout)
                assert k0.shape == (16, 2, 4, 4) and k0.dtype == np.float32
                heads_of_rank = [2 * pool.tp_rank, 2 * pool.tp_rank + 1]
                assert [int(k0[7, h].view(np.int32)[0, 0]) for h in range(2)] == [tag(0, h) for h in heads_of_rank]
                assert k0[8].view(np.int32)[0, :, 1].tolist() == [4, 5, 6, 7]  # tokens of block position 1
            dinfo = await dc.get_info()
            assert dinfo.pools[0].shm_name == "" and dinfo.pools[0].size_bytes == pool_layout.size_bytes
            pub = await pc.publish_blocks("emb-1", [[7, 8]])
            await dc.transfer("d-emb-1", pub.params, [[2, 3]])
            errs = check_rank(RankMemory(pool_layout.regions, engine_kv), 0, 1, 4, [[2, 3]], 4)
            assert not errs, errs
    finally:
        await running.stop(0)
        p.stop()
