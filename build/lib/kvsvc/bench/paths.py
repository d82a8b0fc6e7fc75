"""The paths bytes take in the benchmark, each timed the same way: kvsvc Transfer (one at a
time or many in flight), raw NIXL on the very descriptors kvsvc plans, and one memcpy."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvsvc.client import AsyncClient
from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.mapping.planner import Side, plan_rank
from kvsvc.memory.pools import CudaPool, MemoryKind, ShmPool
from kvsvc.v1 import kv_transfer_pb2 as pb


class Transferer(Protocol):
    """What runs a Transfer: AsyncClient (a unary call each) or its TransferChannel (a
    message each on one TransferStream)."""

    async def transfer(self, request_id: str, params: pb.TransferParams,
                       local_block_ids_per_group: Sequence[Sequence[int]], *,
                       timeout_s: float | None = None) -> pb.TransferResponse: ...


@dataclass
class Samples:
    """Durations in seconds of one path, and what each moved."""

    transfer: list[float] = field(default_factory=list)
    wire: list[float] = field(default_factory=list)
    nbytes: int = 0
    descriptors: int = 0
    elapsed: float = 0.0


def wire_seconds(resp: pb.TransferResponse) -> float:
    """The READs' time on the wire: the slowest rank's, from post to completion."""
    return max((r.duration_us for r in resp.ranks), default=0) / 1e6


async def kvsvc_sequential(pc: AsyncClient, dc: Transferer, p_ids: list[int], d_ids: list[int], runs: int,
                           tag: str, warmup: int = 1) -> Samples:
    """Publish, then time Transfer, one request at a time; the first `warmup` runs are not kept."""
    out = Samples()
    for i in range(warmup + runs):
        pub = await pc.publish_blocks(f"bench-{tag}-{i}", [p_ids])
        t0 = time.perf_counter()
        resp = await dc.transfer(f"bench-d-{tag}-{i}", pub.params, [d_ids], timeout_s=120)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            out.transfer.append(elapsed)
            out.wire.append(wire_seconds(resp))
        out.nbytes, out.descriptors = resp.total_bytes, sum(r.num_descriptors for r in resp.ranks)
    return out


async def kvsvc_concurrent(pc: AsyncClient, dc: Transferer, requests: int, in_flight: int,
                           blocks: Callable[[int], tuple[list[int], list[int]]], tag: str) -> Samples:
    """`requests` Transfers with `in_flight` at a time; leases are published first, so the
    figures are D's and P's transfer work alone (publishing is the P engine's)."""
    pubs = []
    for i in range(requests):
        p_ids, _ = blocks(i)
        pubs.append(await pc.publish_blocks(f"bench-{tag}-{i}", [p_ids]))
    out = Samples()
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            resp = await dc.transfer(f"bench-d-{tag}-{i}", pubs[i].params, [blocks(i)[1]], timeout_s=120)
            out.transfer.append(time.perf_counter() - t0)
            out.wire.append(wire_seconds(resp))
            out.nbytes += resp.total_bytes

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    out.elapsed = time.perf_counter() - t0
    return out


class RawNixl:
    """A NIXL agent of this process reading P's blocks directly: the same coalesced
    descriptors kvsvc would post, with no RPC, no lease, and a busy completion poll."""

    def __init__(self, pc: AsyncClient, local_layout: pb.KvLayout, local_tp: int, name: str,
                 memory: str = "dram") -> None:
        self.pc, self.name, self.memory = pc, name, memory
        self.side = Side.of(layout_from_proto(local_layout, tp_size=local_tp), local_tp)
        self._agent: Any = None
        self._pool: ShmPool | CudaPool | None = None
        self._reg: Any = None
        self._peer = ""

    async def start(self) -> None:
        from kvsvc.transport.nixl_agents import load_nixl
        from kvsvc.transport.ucx_cuda import allow_cuda_ipc_reads

        if self.memory == "vram":
            allow_cuda_ipc_reads()  # as kvsvc's servers do, before this process's first agent
        api = load_nixl()
        hs = await self.pc.handshake(pb.HandshakeRequest(engine_id=self.name, tp_size=self.side.tp_size,
                                                         layout=layout_to_proto(self.side.layout)))
        self.remote_side = Side.of(layout_from_proto(hs.layout, tp_size=hs.tp_size), hs.tp_size)
        self.remote = hs.ranks[0]
        # The READs land in the same kind of memory as on D: a shared-memory pool with every
        # page backed, or GPU memory. (Into this process's private memory they ran at
        # 1.6-2.3 GB/s here against 5.4-5.6 into shared memory, which compared the memory,
        # not kvsvc.)
        if self.memory == "vram":
            self._pool = CudaPool(0, self.side.pool.size_bytes, 0)
        else:
            self._pool = ShmPool(0, self.side.pool.size_bytes, f"kvsvc-bench-raw-{os.getpid()}-{id(self):x}")
        pool = self._pool
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg = self._agent.register_memory([(pool.base_address, pool.size_bytes, pool.device_id, "")],
                                                pool.memory_kind)
        peer = self._agent.add_remote_agent(self.remote.agent_metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else peer
        self._agent.make_connection(self._peer)

    def run(self, p_ids: Sequence[int], d_ids: Sequence[int], runs: int) -> tuple[list[float], int]:
        plan = plan_rank(self.side, self.remote_side, 0, [list(d_ids)], [list(p_ids)])
        (reads,) = plan.reads
        pool = self._pool
        assert pool is not None, "start() first"
        local_base = np.array([pool.region_address(r) for r in self.side.pool.regions], np.int64)
        remote_base = np.array([r.base_address for r in self.remote.regions], np.int64)
        la = local_base[reads.local_region] + reads.local_offset
        ra = remote_base[reads.remote_region] + reads.remote_offset
        agent = self._agent
        remote_kind = MemoryKind.VRAM if self.remote.memory_kind == pb.MEMORY_KIND_VRAM else MemoryKind.DRAM
        local = agent.get_xfer_descs(np.stack([la, reads.length, np.full_like(reads.length, pool.device_id)], 1)
                                     .astype(np.uint64), pool.memory_kind)
        remote = agent.get_xfer_descs(np.stack([ra, reads.length, np.full_like(reads.length, self.remote.device_id)],
                                               1).astype(np.uint64), remote_kind)
        times = []
        for i in range(runs + 1):  # run 0 warms the descriptors and endpoints
            handle = agent.initialize_xfer("READ", local, remote, self._peer)
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - t0
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ failed: {state}")
            if i:
                times.append(elapsed)
        return times, reads.nbytes

    def close(self) -> None:
        """Idempotent, and safe after a start() that failed half way."""
        if self._agent is not None:
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
            if self._peer:
                self._agent.remove_remote_agent(self._peer)
            self._agent = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def memcpy_runs(nbytes: int, runs: int, memory: str = "dram") -> list[float]:
    """One copy of nbytes between two buffers of this process whose pages are already in
    (on the GPU for "vram": a device-to-device copy, timed to its completion)."""
    if memory == "vram":
        import torch

        src_t = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst_t = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        dst_t.copy_(src_t)
        torch.cuda.synchronize()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            dst_t.copy_(src_t)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    dst[:] = 1
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return times


async def rpc_round_trips(client: AsyncClient, n: int) -> list[float]:
    """Health-check round trips: what the lightest gRPC call costs on this host, the floor
    under any Transfer (which is one gRPC call)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(client.channel)
    out = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        await stub.Check(health_pb2.HealthCheckRequest())
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return out
