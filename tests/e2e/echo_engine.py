"""A third engine's kvsvc integration, as small as one can be: "echo", an engine whose model
writes each token's K and V as a function of the token, its position and the layer.

It exists to show (and count) what an engine adds to use kvsvc: this one file, over the
engine-neutral layer (integrations/embedded.EmbeddedServer, integrations/description,
integrations/settings). Its KV is its own arrays, one per layer, [blocks, heads, tokens,
K+V] (vLLM's packed HND); P leases a request's blocks and frees them when kvsvc says D is
done; D loads a request's KV into blocks of its own.
"""

from __future__ import annotations

import threading

import numpy as np

from kvsvc.config import Role, load_config
from kvsvc.integrations.description import CacheDescription, LayerGroup, numbered_groups
from kvsvc.integrations.embedded import EmbeddedServer
from kvsvc.layout.engine import EngineLayout, KvMemoryLayout, RegionLayout
from kvsvc.layout.specs import DType, FullAttentionSpec
from kvsvc.leases.table import LeaseState
from kvsvc.v1 import kv_transfer_pb2 as pb

LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 2, 8, 4, 32


def token_kv(tokens: list[int], layer: int) -> np.ndarray:
    """The model: [tokens, heads, K+V] for one layer (what prefill computes)."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None, None]
    lanes = np.arange(HEADS * 2 * HEAD_DIM, dtype=np.float32).reshape(1, HEADS, 2 * HEAD_DIM)
    return ((t * 0.5 + pos * 0.25 + layer + lanes / 64) % 64).astype(np.float16)


class EchoEngine:
    def __init__(self, role: Role, engine_id: str, token: str) -> None:
        self.role, self.token = role, token
        self.kv = [np.zeros((BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), np.float16) for _ in range(LAYERS)]
        self.free = list(range(BLOCKS))
        self.held: dict[str, list[int]] = {}  # P: a request's blocks until kvsvc releases them
        self.freed = threading.Condition()
        spec = FullAttentionSpec(BLOCK, HEADS, HEAD_DIM, DType.FLOAT16)
        layout = EngineLayout(model_id="echo", total_num_kv_heads=HEADS, block_size=BLOCK, num_blocks=BLOCKS,
                              groups=numbered_groups([LayerGroup("full", spec, LAYERS)]),
                              kv_memory_layout=KvMemoryLayout.HND, region_layout=RegionLayout.PACKED_KV)
        config = load_config(listen="127.0.0.1:0", engine_id=engine_id, role=role, tp_size=1, ranks=[0],
                             engine_layout=layout)
        self.server = EmbeddedServer(config, CacheDescription(layout, self.kv), advertise_host="127.0.0.1",
                                     on_release=self._released if role is Role.PREFILL else None)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def _take(self, n: int) -> list[int]:
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def _write(self, blocks: list[int], tokens: list[int]) -> None:
        for layer, kv in enumerate(self.kv):
            rows = token_kv(tokens, layer)
            for i, row in enumerate(rows):
                kv[blocks[i // BLOCK], :, i % BLOCK, :] = row

    def read(self, blocks: list[int], num_tokens: int, layer: int) -> np.ndarray:
        """[tokens, heads, K+V] of one layer, gathered from the blocks."""
        kv = self.kv[layer]
        return np.stack([kv[blocks[i // BLOCK], :, i % BLOCK, :] for i in range(num_tokens)])

    # ---- P ----

    def prefill(self, request_id: str, tokens: list[int]) -> pb.TransferParams:
        blocks = self._take(-(-len(tokens) // BLOCK))
        self._write(blocks, tokens)
        self.held[request_id] = blocks
        return self.server.lease(request_id, [blocks], self.token, num_tokens=len(tokens))

    def _released(self, request_id: str, how: LeaseState) -> None:
        with self.freed:  # D is done with them (however it ended): the blocks are the engine's again
            self.free += self.held.pop(request_id, [])
            self.freed.notify_all()

    # ---- D ----

    def load(self, request_id: str, params: pb.TransferParams, num_tokens: int) -> list[int]:
        blocks = self._take(-(-num_tokens // BLOCK))
        self.server.transfer(request_id, params, [blocks], timeout_s=30).result(60)
        return blocks
