"""GetInfo tells the engine how long its server took to back the pool's pages at start."""

from __future__ import annotations

from kvsvc.client import AsyncClient
from kvsvc.config import MemoryMode, Role, load_config
from kvsvc.service.server import create_server


async def test_get_info_reports_pool_population():
    layout = {"model_id": "pop", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": 512, "dtype": "bfloat16",
              "groups": [{"name": "full", "kind": "full_attention", "num_layers": 4, "head_size": 128}]}
    running, port = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, role=Role.DECODE,
                                                    memory=MemoryMode.DRAM, layout_table=layout))
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            (pool,) = (await client.get_info()).pools
        assert pool.size_bytes >= 128 << 20  # 512 blocks of 256 KiB: every page was written at start
        assert pool.populate_ms == int(running.node.pools[0].populate_s * 1000) and pool.populate_ms > 0
    finally:
        await running.stop(0)
