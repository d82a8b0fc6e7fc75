"""The connector's D worker, without a vLLM engine around it: a transfer vLLM cancels is
reported finished (after which vLLM frees and may reuse its blocks) only once nothing of it
writes into them any more. A real P server process, real NIXL, the worker's embedded D server."""

from __future__ import annotations

import asyncio
import random
import time

import torch

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.config import Role
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata, Receive
from kvsvc.integrations.vllm.worker import KvsvcWorker
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout

# 512 KiB blocks (8 layers x K and V x 32 KiB): a 64-block request takes tens of ms to read here.
TABLE = {"model_id": "w", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": 200, "dtype": "bfloat16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 8, "head_size": 128}]}


def _buffers() -> list[torch.Tensor]:
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    return [torch.full((r.num_blocks, r.block_len), 0xAB, dtype=torch.uint8) for r in regions]


def _wait_reported(worker: KvsvcWorker, req_id: str, timeout_s: float = 30.0) -> tuple[bool, bool]:
    """(reported finished receiving, reported failed), polling as vLLM does each step."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        _, recving, failed = worker.transfer_results(set())
        if req_id in recving:
            return True, req_id in failed
        time.sleep(0.001)
    return False, False


def test_a_cancelled_transfer_is_reported_only_once_settled():
    p = start_server(engine_id="w-p", role="prefill", tp_size=1, layout=TABLE)
    buffers = _buffers()
    worker = KvsvcWorker(engine_id="w-d", role=Role.DECODE, tp_rank=0, tp_size=1)
    try:
        info = worker.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), buffers))
        rng = random.Random(3)
        late_writes, cancelled = 0, 0

        async def publish(rid: str):
            async with AsyncClient(p.address) as pc:
                return await pc.publish_blocks(rid, [list(range(64))])

        for trial in range(16):
            for b in buffers:
                b.fill_(0xAB)
            pub = asyncio.run(publish(f"c{trial}"))
            req_id = f"dc{trial}"
            params = kvparams.to_vllm(pub.params, num_tokens=64 * 16, tp_size=1, dcp_size=1)
            recv = Receive(local_block_ids=[list(range(100, 164))], params=params, awaiting=True)
            worker.start_load_kv(KvsvcConnectorMetadata(receive={req_id: recv}))
            time.sleep(rng.uniform(0, 0.03))
            worker.start_load_kv(KvsvcConnectorMetadata(cancel={req_id}))
            reported, failed = _wait_reported(worker, req_id)
            assert reported, f"{req_id} was never reported finished"
            cancelled += failed
            snapshot = [b.clone() for b in buffers]  # vLLM may reuse the blocks from here on
            time.sleep(0.1)
            late_writes += any(not torch.equal(b, s) for b, s in zip(buffers, snapshot, strict=True))
        assert late_writes == 0, f"{late_writes} transfers wrote after they were reported finished"
        assert cancelled > 0, "no transfer was cancelled mid-read: the test checked nothing"
        assert info.address
    finally:
        worker.shutdown()
        p.stop()
