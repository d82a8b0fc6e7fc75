"""The benchmark run: two servers (started here, or given by address), then

1. a sweep of request sizes (1 block up to --max-mib), blocks shuffled and contiguous:
   kvsvc Transfer end to end and on the wire, raw NIXL on the same descriptors, memcpy;
   CPU seconds per GB of the P and D servers;
2. cold vs warm: a 2 MiB request into D blocks nothing wrote before, then again;
3. 1-block requests with 1, 8, 32 in flight: percentiles and transfers per second;
4. the floor: a bare gRPC round trip, and the servers' CPU when idle.

Block ids are laid out so the parts never share D blocks: [0, largest) for the sweep,
then the cold blocks, then the concurrency slots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.bench.measure import CpuMeter, Progress, cpu_seconds, gbps, ms
from kvsvc.bench.paths import (
    RawNixl,
    Samples,
    Transferer,
    kvsvc_concurrent,
    kvsvc_sequential,
    memcpy_runs,
    rpc_round_trips,
)
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.client.attach import AttachedPool, attach_pool
from kvsvc.client.transfer_stream import TransferChannel
from kvsvc.codec import layout_from_proto
from kvsvc.errors import KvsvcError
from kvsvc.layout.build import simple_layout
from kvsvc.layout.regions import build_pool_layout
from kvsvc.mapping.planner import Side, plan_rank
from kvsvc.reasons import Reason
from kvsvc.service.prefill import HANDSHAKE_PROGRESS_S
from kvsvc.v1 import kv_transfer_pb2 as pb

MIB = 1 << 20
COLD_MIB = 2
# Pairs of a cold and a warm 2 MiB request; the ratio is of their medians. A 2 MiB READ
# takes ~0.4 ms here, within this VM's jitter: five pairs gave 0.92-1.22 run to run.
COLD_TRIALS = 15
CONCURRENCY_SLOTS = 64  # D blocks the in-flight requests rotate over (more than the most in flight)
# How the concurrency sweep runs its transfers, side by side (see concurrency_point).
APIS = ("stream", "grpc-stream", "unary")


def bench_layout(layers: int, num_blocks: int) -> dict[str, Any]:
    """GQA, 8 KV heads of 128, bf16, blocks of 16 tokens: 64 KiB per layer and block (K and V)."""
    return {"model_id": "kvsvc-bench", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": num_blocks,
            "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": layers,
                                             "head_size": 128}]}


def block_bytes_of(layers: int) -> int:
    return 8 * 16 * 128 * 2 * 2 * layers


def sizes_in_blocks(block_bytes: int, max_mib: float) -> list[int]:
    """1 block, then 2, 16 and max_mib MiB worth of blocks (those not above max_mib)."""
    wanted = [m for m in (COLD_MIB, 16, max_mib) if m <= max_mib]
    return sorted({1, *(max(1, math.ceil(m * MIB / block_bytes)) for m in wanted)})


@dataclass
class Target:
    """The two servers, their clients, attached pools (when this process may map them) and
    the pids whose CPU is counted (servers started here)."""

    pc: AsyncClient
    dc: AsyncClient
    p_info: pb.GetInfoResponse
    d_info: pb.GetInfoResponse
    xfer: TransferChannel
    """How the kvsvc path runs its Transfers: on one TransferStream, as an engine does (on
    D's transfer socket when it offers one this process can reach, else over gRPC)."""
    xfer_grpc: TransferChannel
    """The same always over gRPC (the concurrency sweep compares them)."""
    pids: dict[str, int] = field(default_factory=dict)
    p_pool: AttachedPool | None = None
    d_pool: AttachedPool | None = None


def client_options(args: argparse.Namespace) -> ClientOptions:
    return ClientOptions().with_pem_files(args.ca, args.cert, args.key) if args.ca else ClientOptions()


def _attach(info: pb.GetInfoResponse) -> AttachedPool | None:
    """The server's first pool mapped here, when it is shared memory on this host or GPU
    memory this process can open (CUDA IPC)."""
    if not info.pools:
        return None
    pool = info.pools[0]
    if pool.memory_kind == pb.MEMORY_KIND_DRAM and not pool.shm_name:
        return None
    try:
        return attach_pool(pool)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: CUDA IPC refused (another host, no device)
        return None
    except KvsvcError as e:
        if e.reason == Reason.POOL_NOT_FOUND:  # shared memory of a server on another host
            return None
        raise


@contextlib.asynccontextmanager
async def target(args: argparse.Namespace, num_blocks: int) -> AsyncIterator[Target]:
    from kvsvc.cli.procs import start_server

    started = []
    if args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise SystemExit("kvsvc bench: give both --prefill and --decode, or neither")
        p_addr, d_addr = args.prefill, args.decode
    else:
        table = bench_layout(args.layers, num_blocks)
        started = [start_server(engine_id="bench-prefill", role="prefill", tp_size=1, layout=table,
                                memory=args.memory),
                   start_server(engine_id="bench-decode", role="decode", tp_size=1, layout=table,
                                memory=args.memory)]
        p_addr, d_addr = started[0].address, started[1].address
    opts = client_options(args)
    try:
        async with AsyncClient(p_addr, opts) as pc, AsyncClient(d_addr, opts) as dc:
            t = Target(pc, dc, await pc.get_info(), await dc.get_info(), dc.transfer_stream(),
                       dc.transfer_stream("grpc"))
            if started:
                t.pids = {"prefill": started[0].proc.pid, "decode": started[1].proc.pid, "client": os.getpid()}
            t.p_pool, t.d_pool = _attach(t.p_info), _attach(t.d_info)
            try:
                yield t
            finally:
                await t.xfer.close()
                await t.xfer_grpc.close()
                for pool in (t.p_pool, t.d_pool):
                    if pool is not None:
                        pool.close()
    finally:
        for sp in started:
            sp.stop()


def verified(t: Target, p_ids: list[int], d_ids: list[int]) -> bool | None:
    """D's blocks equal P's, region by region; None when the pools cannot be mapped here."""
    if t.p_pool is None or t.d_pool is None:
        return None
    regions = build_pool_layout(layout_from_proto(t.p_info.layout, tp_size=t.p_info.tp_size)).regions
    return all(same_bytes(t.d_pool.region(t.d_info.pools[0].regions[r.index])[d_ids],
                          t.p_pool.region(t.p_info.pools[0].regions[r.index])[p_ids]) for r in regions)


def same_bytes(a: Any, b: Any) -> bool:
    """Two numpy arrays or two torch tensors (GPU ones compared on the GPU) hold equal bytes."""
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    import torch

    return bool(torch.equal(a, b))


def fill_random(pool: AttachedPool, rng: np.random.Generator) -> None:
    """Random bytes over a whole pool (P's), so a wrong block can never compare equal."""
    data = rng.integers(0, 256, pool.buffer.shape[0], dtype=np.uint8)
    if isinstance(pool.buffer, np.ndarray):
        pool.buffer[:] = data
        return
    import torch

    pool.buffer.copy_(torch.from_numpy(data))
    torch.cuda.synchronize(pool.buffer.device)


def _latency(s: Samples) -> dict[str, float]:
    return {"transfer_p50_ms": ms(s.transfer, 50), "transfer_p99_ms": ms(s.transfer, 99),
            "wire_p50_ms": ms(s.wire, 50), "wire_p99_ms": ms(s.wire, 99)}


def _cpu_per_gb(cpu: dict[str, float], nbytes: int) -> dict[str, float]:
    return {f"{name}_cpu_s_per_gb": sec / (nbytes / 1e9) for name, sec in cpu.items() if nbytes}


async def size_point(t: Target, raw: RawNixl | None, n: int, pattern: str, p_ids: list[int], d_ids: list[int],
                     runs: int, memory: str = "dram") -> dict[str, Any]:
    """Every path for one request size and block pattern; medians and percentiles."""
    meter = CpuMeter(t.pids)
    meter.start()
    ks = await kvsvc_sequential(t.pc, t.xfer, p_ids, d_ids, runs, f"{pattern}-{n}")
    cpu = meter.stop()
    row: dict[str, Any] = {"blocks": n, "pattern": pattern, "bytes": ks.nbytes, "descriptors": ks.descriptors,
                           "verified": verified(t, p_ids, d_ids), **_latency(ks),
                           **_cpu_per_gb(cpu, ks.nbytes * (runs + 1))}
    med = statistics.median
    row["kvsvc_transfer_gbps"] = gbps(ks.nbytes, med(ks.transfer))
    row["kvsvc_wire_gbps"] = gbps(ks.nbytes, med(ks.wire))
    if raw is not None:
        # Under a lease, as an engine reading P with its own NIXL would (PlanTransfer after
        # PublishBlocks): P progresses UCX while a lease lives, which a READ over TCP needs.
        held = await t.pc.publish_blocks(f"raw-{pattern}-{n}", [p_ids], lease_ttl_ms=300_000)
        try:
            times, raw_bytes = raw.run(p_ids, d_ids, runs)
        finally:
            await t.pc.notify(pb.NotifyRequest(request_id=held.params.remote_request_id, kind=pb.NOTIFY_KIND_ABORTED,
                                               lease_epoch=held.params.remote_epoch,
                                               lease_token=held.params.lease_token, withdraw=True))
        row.update(raw_nixl_ms=1e3 * med(times), raw_nixl_gbps=gbps(raw_bytes, med(times)), raw_nixl_bytes=raw_bytes)
    mem = memcpy_runs(ks.nbytes, runs, memory)
    row.update(memcpy_ms=1e3 * med(mem), memcpy_gbps=gbps(ks.nbytes, med(mem)))
    return row


async def cold_vs_warm(t: Target, first_block: int, n: int) -> dict[str, Any]:
    """Wire time of a request into D blocks nothing wrote before, then of the same request again."""
    cold: list[float] = []
    warm: list[float] = []
    for k in range(COLD_TRIALS):
        d_ids = list(range(first_block + k * n, first_block + (k + 1) * n))
        for label, into in (("cold", cold), ("warm", warm)):
            s = await kvsvc_sequential(t.pc, t.xfer, list(range(n)), d_ids, 1, f"{label}{k}", warmup=0)
            into.extend(s.wire)
    med = statistics.median
    return {"blocks": n, "cold_wire_p50_ms": 1e3 * med(cold), "warm_wire_p50_ms": 1e3 * med(warm),
            "cold_over_warm": med(cold) / med(warm) if med(warm) > 0 else 0.0}


async def concurrency_point(t: Target, in_flight: int, requests: int, p_blocks: int, first_slot: int,
                            api: str) -> dict[str, Any]:
    """1-block requests, in_flight at a time, on the TransferStream as engines run it (api
    "stream": on D's transfer socket where there is one), on the TransferStream over gRPC
    ("grpc-stream") or as unary Transfer calls ("unary")."""
    meter = CpuMeter(t.pids)
    meter.start()
    runners: dict[str, Transferer] = {"stream": t.xfer, "grpc-stream": t.xfer_grpc, "unary": t.dc}
    runner = runners[api]
    s = await kvsvc_concurrent(t.pc, runner, requests, in_flight,
                               lambda i: ([i % p_blocks], [first_slot + i % CONCURRENCY_SLOTS]),
                               f"{api}-{in_flight}")
    cpu = meter.stop()
    return {"in_flight": in_flight, "api": api, "requests": requests, "transfers_per_s": requests / s.elapsed,
            "gbps": gbps(s.nbytes, s.elapsed), **_latency(s), **_cpu_per_gb(cpu, s.nbytes)}


def plan_128k_ms() -> tuple[float, int]:
    """Plan one 128k-token request (8192 blocks of 16) over 61 MLA layers, P TP 4 -> D TP 1."""
    d = Side.of(simple_layout(tp_size=1, mla=True, num_layers=61, num_blocks=8192, head_size=576), 1)
    p = Side.of(simple_layout(tp_size=4, mla=True, num_layers=61, num_blocks=8192, head_size=576), 4)
    ids = np.random.default_rng(0).permutation(8192)
    t0 = time.perf_counter()
    plan = plan_rank(d, p, 0, [ids], [np.arange(8192)])
    return (time.perf_counter() - t0) * 1e3, plan.num_descriptors


PLAN_LAYERS = (4, 32, 80)


def plan_one_block_us() -> dict[str, float]:
    """Median time to plan a 1-block request (GQA, the bench's geometry) for models of
    PLAN_LAYERS layers: what a short request pays on D for planning, by model depth (the
    pair's compatibility is checked once per handshake, so not here)."""
    out = {}
    for layers in PLAN_LAYERS:
        side = Side.of(simple_layout(tp_size=1, kv_heads=8, num_layers=layers, head_size=128, num_blocks=1024), 1)
        times = []
        for i in range(200):
            t0 = time.perf_counter()
            plan_rank(side, side, 0, [[i % 512]], [[(i * 7) % 1024]], validated=True)
            times.append(time.perf_counter() - t0)
        out[str(layers)] = 1e6 * statistics.median(times[20:])
    return out


async def idle_cpu_percent(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU use of idle servers: the progress pump must sleep when nothing is in flight."""
    servers = {k: v for k, v in pids.items() if k != "client"}
    before = {k: cpu_seconds(p) for k, p in servers.items()}
    await asyncio.sleep(seconds)
    return {k: 100 * (cpu_seconds(p) - before[k]) / seconds for k, p in servers.items()}


async def size_sweep(t: Target, args: argparse.Namespace, sizes: list[int], rng: np.random.Generator,
                     progress: Progress) -> tuple[list[dict[str, Any]], str]:
    """Every request size, blocks shuffled and contiguous: (rows, why raw NIXL was skipped or "")."""
    raw: RawNixl | None = None
    raw_error = ""
    try:
        raw = RawNixl(t.pc, t.d_info.layout, t.d_info.tp_size, f"bench-raw-{os.getpid()}", args.memory)
        await raw.start()
    except Exception as e:  # a remote P that does not accept this process as a peer
        if raw is not None:
            raw.close()
        raw, raw_error = None, f"{type(e).__name__}: {e}"
    largest = sizes[-1]
    points = []
    try:
        for n in sizes:
            patterns = {
                # an allocator's free list after a while: no two blocks adjacent on both sides
                "shuffled": (rng.choice(largest, n, replace=False).tolist(),
                             rng.choice(largest, n, replace=False).tolist()),
                # a fresh allocator: one run per region after coalescing
                "contiguous": (list(range(n)), list(range(n))),
            }
            for pattern, (p_ids, d_ids) in patterns.items():
                row = await size_point(t, raw, n, pattern, p_ids, d_ids, args.runs, args.memory)
                points.append(row)
                progress.step(f"{row['bytes'] / MIB:.2f} MiB {pattern}: kvsvc {row['kvsvc_transfer_gbps']:.2f} "
                              f"GB/s, raw NIXL {row.get('raw_nixl_gbps', 0):.2f} GB/s")
    finally:
        if raw is not None:
            raw.close()
    return points, raw_error


async def concurrency_sweep(t: Target, args: argparse.Namespace, concurrency: list[int], p_blocks: int,
                            first_slot: int, progress: Progress) -> list[dict[str, Any]]:
    """1-block requests at each level in flight, every API side by side."""
    conc = []
    for c in concurrency:
        for api in APIS:  # side by side, the stream first as engines use it
            row = await concurrency_point(t, c, args.requests if c > 1 else max(50, args.requests // 2),
                                          p_blocks, first_slot, api)
            conc.append(row)
            progress.step(f"{c} in flight ({api}): {row['transfers_per_s']:.0f} transfers/s, p99 "
                          f"{row['transfer_p99_ms']:.2f} ms")
    return conc


async def run(args: argparse.Namespace) -> dict[str, Any]:
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    block_bytes = block_bytes_of(args.layers)
    sizes = sizes_in_blocks(block_bytes, args.max_mib)
    largest, cold_n = sizes[-1], max(1, math.ceil(COLD_MIB * MIB / block_bytes))
    cold_first = largest
    slots_first = cold_first + COLD_TRIALS * cold_n
    async with target(args, slots_first + CONCURRENCY_SLOTS) as t:
        for side, info in (("prefill", t.p_info), ("decode", t.d_info)):
            need = slots_first + CONCURRENCY_SLOTS if side == "decode" else largest
            if info.layout.num_blocks < need:
                raise SystemExit(f"kvsvc bench: the {side} server has {info.layout.num_blocks} blocks; this run "
                                 f"needs {need} (lower --max-mib)")
        # As a server does (and an engine should) once started: what exists now lives as long
        # as the run, and a full collection of it would stall the transfers in flight.
        gc.collect()
        gc.freeze()
        progress = Progress(2 * len(sizes) + 1 + len(APIS) * len(concurrency) + 2, args.quiet)
        rng = np.random.default_rng(1)
        if t.p_pool is not None:
            fill_random(t.p_pool, rng)
        points, raw_error = await size_sweep(t, args, sizes, rng, progress)
        cold = await cold_vs_warm(t, cold_first, cold_n)
        progress.step(f"cold vs warm: {cold['cold_over_warm']:.2f}")
        conc = await concurrency_sweep(t, args, concurrency, largest, slots_first, progress)
        carrier = t.xfer.carrier  # what the engine-style stream ran on
        rtt = await rpc_round_trips(t.dc, 200)
        # To P as well: where P is on another host, the round trip of the link D reads over.
        rtt_p = await rpc_round_trips(t.pc, 200)
        progress.step(f"gRPC round trip p50 {ms(rtt, 50):.3f} ms (to P: {ms(rtt_p, 50):.3f} ms)")
        d_transport = (await t.dc.get_info()).transport
        transports = list(d_transport.ucx_transports)
        idle: dict[str, float] = {}
        if t.pids:
            await asyncio.sleep(HANDSHAKE_PROGRESS_S)  # past P's post-handshake progress window
            idle = await idle_cpu_percent(t.pids, 2.0)
        progress.step("idle CPU")
    res = summarise(points, cold, conc, ms(rtt, 50), transports, idle, raw_error, args, carrier)
    res["decode_copy_threads"] = d_transport.copy_threads
    res["grpc_round_trip_p50_ms_prefill"] = ms(rtt_p, 50)
    return res


def _ends(conc: list[dict[str, Any]], api: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """api's row at 1 in flight and its row with the most in flight (None: no such row)."""
    rows = [c for c in conc if c["api"] == api]
    return next((c for c in rows if c["in_flight"] == 1), None), max(rows, key=lambda c: c["in_flight"], default=None)


def _overhead(row: dict[str, Any] | None) -> float | None:
    return row["transfer_p50_ms"] - row["wire_p50_ms"] if row else None


def summarise(points: list[dict[str, Any]], cold: dict[str, Any], conc: list[dict[str, Any]], rtt_ms: float,
              transports: list[str], idle: dict[str, float], raw_error: str, args: argparse.Namespace,
              carrier: str = "") -> dict[str, Any]:
    """The headline figures (stable JSON keys) over the detailed rows."""
    largest = max(p["blocks"] for p in points)
    big = {p["pattern"]: p for p in points if p["blocks"] == largest}
    one, many = _ends(conc, "stream")
    one_grpc, many_grpc = _ends(conc, "grpc-stream")
    one_unary, many_unary = _ends(conc, "unary")
    single = next(p for p in points if p["blocks"] == 1 and p["pattern"] == "shuffled")
    ratio = {f"kvsvc_over_raw_nixl_{k}": (v["kvsvc_transfer_gbps"] / v["raw_nixl_gbps"]) if v.get("raw_nixl_gbps")
             else None for k, v in big.items()}
    plan_ms, plan_desc = plan_128k_ms()
    checks = [p["verified"] for p in points if p["verified"] is not None]
    shuffled = big["shuffled"]
    return {
        # headline, largest request, shuffled blocks (the keys earlier versions wrote)
        "bytes_per_transfer": shuffled["bytes"], "descriptors_per_transfer": shuffled["descriptors"],
        "kvsvc_transfer_gbps": shuffled["kvsvc_transfer_gbps"], "kvsvc_wire_gbps": shuffled["kvsvc_wire_gbps"],
        "raw_nixl_gbps": shuffled.get("raw_nixl_gbps"), "memcpy_gbps": shuffled["memcpy_gbps"], **ratio,
        "overhead_p50_ms": (one or single)["transfer_p50_ms"] - (one or single)["wire_p50_ms"],
        "transfers_per_s": many["transfers_per_s"] if many else None,
        "transfers_per_s_in_flight": many["in_flight"] if many else None,
        # the same on the TransferStream over gRPC, and with a unary Transfer call per request
        "overhead_p50_ms_grpc_stream": _overhead(one_grpc),
        "transfers_per_s_grpc_stream": many_grpc["transfers_per_s"] if many_grpc else None,
        "overhead_p50_ms_unary": _overhead(one_unary),
        "transfers_per_s_unary": many_unary["transfers_per_s"] if many_unary else None,
        "transfer_api": "stream", "transfer_carrier": carrier,
        "cold_over_warm": cold["cold_over_warm"],
        "grpc_round_trip_p50_ms": rtt_ms,
        "verified": all(checks) if checks else None,
        "idle_cpu_percent_prefill": idle.get("prefill"), "idle_cpu_percent_decode": idle.get("decode"),
        "plan_128k_tokens_61_layers_ms": plan_ms, "plan_128k_descriptors": plan_desc,
        "plan_1_block_us_by_layers": plan_one_block_us(),
        "ucx_transports": transports, "raw_nixl_error": raw_error,
        "layers": args.layers, "runs": args.runs, "max_mib": args.max_mib, "memory": getattr(args, "memory", "dram"),
        "sizes": points, "cold": cold, "concurrency": conc,
    }
