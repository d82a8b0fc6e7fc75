"""A streamed load's deadline: it begins before P prefills (the router sends the request to P
and D at once), so it holds P's queue and prefill -- stream_timeout_s -- where a pulled load's
(transfer_timeout_s) begins after P answered. The connector's D worker, a real P server
process, real NIXL."""

from __future__ import annotations

import asyncio
import time

import torch

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.config import Role
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.settings import EngineSettings
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata, Receive
from kvsvc.integrations.vllm.worker import KvsvcWorker
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout
from kvsvc.v1 import kv_transfer_pb2 as pb

TABLE = {"model_id": "sd", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 32, "dtype": "bfloat16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}
PULLED_S = 1.0  # D's transfer_timeout_s here


def test_a_streamed_load_waits_for_p_past_the_pulled_deadline_and_lands():
    p = start_server(engine_id="sd-p", role="prefill", tp_size=1, layout=TABLE)
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    buffers = [torch.zeros((r.num_blocks, r.block_len), dtype=torch.uint8) for r in regions]
    timeouts = EngineSettings(transfer_timeout_s=PULLED_S, stream_timeout_s=120)
    worker = KvsvcWorker(engine_id="sd-d", role=Role.DECODE, tp_rank=0, tp_size=1, timeout_for=timeouts.timeout_for)
    try:
        worker.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), buffers))

        async def on_p(req: pb.PublishBlocksRequest | pb.CommitBlocksRequest) -> pb.TransferParams | None:
            async with AsyncClient(p.address) as pc:
                if isinstance(req, pb.PublishBlocksRequest):
                    return (await pc.publish_blocks_request(req)).params
                await pc.commit_blocks(req)
                return None

        # P opens the lease at its first chunk (two blocks of 16 tokens) and is still prefilling.
        params = asyncio.run(on_p(pb.PublishBlocksRequest(
            request_id="s1", block_ids_per_group=[pb.BlockIds(block_ids=[1, 2])], num_tokens=32, progressive=True)))
        assert params is not None and params.progressive
        recv = Receive(local_block_ids=[[11, 12, 13, 14]],
                       params=kvparams.to_vllm(params, num_tokens=64, tp_size=1, dcp_size=1), awaiting=True)
        worker.start_load_kv(KvsvcConnectorMetadata(receive={"d-s1": recv}))
        # Three pulled deadlines go by while P computes the rest (what the test checks is a
        # deadline, so it lets time pass): the load must still be waiting on P.
        ended: set[str] = set()
        until = time.monotonic() + 3 * PULLED_S
        while time.monotonic() < until:
            _, recving, _ = worker.transfer_results(set())
            ended |= recving
            time.sleep(0.01)
        assert "d-s1" not in ended, "the streamed load ended before P's last chunk: held to the pulled deadline"
        asyncio.run(on_p(pb.CommitBlocksRequest(request_id="s1", lease_token=params.lease_token, commit_epoch=2,
                                                block_ids_per_group=[pb.BlockIds(block_ids=[3, 4])],
                                                num_tokens=64, final=True)))
        failed: set[str] = set()
        until = time.monotonic() + 60
        while "d-s1" not in ended and time.monotonic() < until:
            _, recving, failing = worker.transfer_results(set())
            ended |= recving
            failed |= failing
            time.sleep(0.01)
        assert "d-s1" in ended and "d-s1" not in failed, f"the streamed load did not land: {ended=} {failed=}"
        totals = worker.totals()
        assert (totals["loaded"], totals["bytes"]) == (1, 4 * sum(r.block_len for r in regions))  # each block once
    finally:
        worker.shutdown()
        p.stop()

