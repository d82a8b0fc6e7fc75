"""`kvsvc bench`: kvsvc Transfer vs the same descriptors posted through raw NIXL vs memcpy, in one run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.client.attach import attach_pool
from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.layout.build import layout_from_dict, simple_layout
from kvsvc.layout.regions import build_pool_layout
from kvsvc.mapping.planner import Side, plan_rank
from kvsvc.service.prefill import HANDSHAKE_PROGRESS_S
from kvsvc.v1 import kv_transfer_pb2 as pb


def bench_layout(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_id": "kvsvc-bench", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": 2 * args.blocks,
            "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": args.layers,
                                             "head_size": 128}]}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


async def kvsvc_runs(pc: AsyncClient, dc: AsyncClient, p_ids: list[int], d_ids: list[int], runs: int, tag: str
                     ) -> tuple[list[float], list[float], int, int]:
    rpc, wire, nbytes, ndesc = [], [], 0, 0
    for i in range(runs + 1):  # run 0 warms the handshake and UCX endpoints
        pub = await pc.publish_blocks(f"bench-{tag}-{i}", [p_ids])
        t0 = time.perf_counter()
        resp = await dc.transfer(f"bench-d-{tag}-{i}", pub.params, [d_ids], timeout_s=120)
        elapsed = time.perf_counter() - t0
        if i:
            rpc.append(elapsed)
            wire.append(max(r.duration_us for r in resp.ranks) / 1e6)
        nbytes, ndesc = resp.total_bytes, sum(r.num_descriptors for r in resp.ranks)
    return rpc, wire, nbytes, ndesc


async def raw_nixl_runs(pc: AsyncClient, layout_table: dict[str, Any], p_ids: list[int], d_ids: list[int],
                        runs: int, agent_name: str) -> tuple[list[float], int]:
    """Post the same coalesced descriptors straight through a NIXL agent of this process (no kvsvc RPCs)."""
    from kvsvc.transport.nixl_agents import load_nixl

    api = load_nixl()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    lay = layout_from_dict(layout_table, 1)
    side = Side.of(lay, 1)
    hs = await pc.handshake(pb.HandshakeRequest(engine_id=agent_name, tp_size=1, layout=layout_to_proto(lay)))
    remote = hs.ranks[0]
    plan = plan_rank(side, Side.of(layout_from_proto(hs.layout, tp_size=hs.tp_size), hs.tp_size), 0, [d_ids], [p_ids])
    buf = np.zeros(side.pool.size_bytes, np.uint8)
    agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(remote.agent_metadata)
    agent.make_connection(name.decode() if isinstance(name, bytes) else name)
    (reads,) = plan.reads
    local_base = np.array([buf.ctypes.data + r.pool_offset for r in side.pool.regions], np.int64)
    remote_base = np.array([r.base_address for r in remote.regions], np.int64)
    la = local_base[reads.local_region] + reads.local_offset
    ra = remote_base[reads.remote_region] + reads.remote_offset
    zeros = np.zeros_like(reads.length)
    local = agent.get_xfer_descs(np.stack([la, reads.length, zeros], 1).astype(np.uint64), "DRAM")
    remote_d = agent.get_xfer_descs(np.stack([ra, reads.length, zeros], 1).astype(np.uint64), "DRAM")
    times = []
    try:
        for i in range(runs + 1):
            h = agent.initialize_xfer("READ", local, remote_d, name)
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            elapsed = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ failed: {state}")
            if i:
                times.append(elapsed)
    finally:
        agent.deregister_memory(reg)
        agent.remove_remote_agent(name)
    return times, reads.nbytes


def memcpy_runs(src: np.ndarray, nbytes: int, runs: int) -> list[float]:
    dst = np.empty(nbytes, np.uint8)
    dst[:] = 1  # fault the pages in first, as the pools' are
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src[:nbytes])
        times.append(time.perf_counter() - t0)
    return times


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu_percent(pids: list[int], seconds: float) -> list[float]:
    """CPU use of idle servers: the progress pump must sleep when nothing is in flight."""
    before = [cpu_seconds(p) for p in pids]
    await asyncio.sleep(seconds)
    return [100 * (cpu_seconds(p) - b) / seconds for p, b in zip(pids, before, strict=True)]


def plan_128k_ms() -> tuple[float, int]:
    """Plan one 128k-token request (8192 blocks of 16) over 61 MLA layers, P TP 4 -> D TP 1."""
    d = Side.of(simple_layout(tp_size=1, mla=True, num_layers=61, num_blocks=8192, head_size=576), 1)
    p = Side.of(simple_layout(tp_size=4, mla=True, num_layers=61, num_blocks=8192, head_size=576), 4)
    ids = np.random.default_rng(0).permutation(8192)
    t0 = time.perf_counter()
    plan = plan_rank(d, p, 0, [ids], [np.arange(8192)])
    return (time.perf_counter() - t0) * 1e3, plan.num_descriptors


async def scenario(name: str, pc: AsyncClient, dc: AsyncClient, pools: tuple[Any, Any], infos: tuple[Any, Any],
                   table: dict[str, Any], p_ids: list[int], d_ids: list[int], runs: int) -> dict[str, Any]:
    """One block pattern, every path, same bytes; medians."""
    pp, dp = pools
    pinfo, dinfo = infos
    rpc, wire, nbytes, ndesc = await kvsvc_runs(pc, dc, p_ids, d_ids, runs, name)
    regions = build_pool_layout(layout_from_proto(pinfo.layout, tp_size=1)).regions
    ok = all(np.array_equal(dp.region(dinfo.pools[0].regions[r.index])[d_ids],
                            pp.region(pinfo.pools[0].regions[r.index])[p_ids]) for r in regions)
    raw, raw_bytes = await raw_nixl_runs(pc, table, p_ids, d_ids, runs, f"bench-raw-{name}")
    mem = memcpy_runs(pp.buffer, nbytes, runs)
    med = statistics.median
    return {
        "bytes_per_transfer": nbytes, "descriptors_per_transfer": ndesc, "verified": ok, "raw_nixl_bytes": raw_bytes,
        "kvsvc_transfer_gbps": gbps(nbytes, med(rpc)), "kvsvc_wire_gbps": gbps(nbytes, med(wire)),
        "raw_nixl_gbps": gbps(raw_bytes, med(raw)), "memcpy_gbps": gbps(nbytes, med(mem)),
        "kvsvc_transfer_ms": med(rpc) * 1e3, "kvsvc_wire_ms": med(wire) * 1e3, "raw_nixl_ms": med(raw) * 1e3,
        "memcpy_ms": med(mem) * 1e3,
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    table = bench_layout(args)
    p = start_server(engine_id="bench-prefill", role="prefill", tp_size=1, layout=table)
    d = start_server(engine_id="bench-decode", role="decode", tp_size=1, layout=table)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            infos = (await pc.get_info(), await dc.get_info())
            rng = np.random.default_rng(1)
            n = args.blocks
            patterns = {
                # an allocator's free list after a while: no two blocks adjacent on both sides
                "shuffled": (rng.permutation(n).tolist(), (n + rng.permutation(n)).tolist()),
                # a fresh allocator: one run per region after coalescing
                "contiguous": (list(range(n)), list(range(n, 2 * n))),
            }
            with attach_pool(infos[0].pools[0]) as pp, attach_pool(infos[1].pools[0]) as dp:
                pp.buffer[:] = rng.integers(0, 256, pp.buffer.size, dtype=np.uint8)
                results = {name: await scenario(name, pc, dc, (pp, dp), infos, table, p_ids, d_ids, args.runs)
                           for name, (p_ids, d_ids) in patterns.items()}
            plan_ms, plan_desc = plan_128k_ms()
            transports = list((await dc.get_info()).transport.ucx_transports)
            await asyncio.sleep(HANDSHAKE_PROGRESS_S)  # past P's post-handshake progress window
            idle = await idle_cpu_percent([p.proc.pid, d.proc.pid], 2.0)
    finally:
        p.stop()
        d.stop()
    return {
        **results["shuffled"], "scenarios": results, "blocks": args.blocks, "layers": args.layers, "runs": args.runs,
        "verified": all(r["verified"] for r in results.values()),
        "plan_128k_tokens_61_layers_ms": plan_ms, "plan_128k_descriptors": plan_desc, "ucx_transports": transports,
        "idle_cpu_percent_prefill": idle[0], "idle_cpu_percent_decode": idle[1],
    }


def run_bench(args: argparse.Namespace) -> int:
    res = asyncio.run(_bench(args))
    print(f"kvsvc bench: {res['bytes_per_transfer'] / 2**20:.1f} MiB per transfer ({res['blocks']} blocks x "
          f"{res['layers']} layers, GQA K=8 head 128 bf16, TP 1 -> 1), median of {res['runs']} runs, "
          f"verified={res['verified']}")
    print(f"{'blocks':<12}{'path':<34}{'descriptors':>12}{'ms':>10}{'GB/s':>10}")
    for name, sc in res["scenarios"].items():
        for label, key in (("kvsvc Transfer (RPC, end to end)", "kvsvc_transfer"),
                           ("kvsvc READs on the wire", "kvsvc_wire"),
                           ("raw NIXL, same descriptors", "raw_nixl"), ("memcpy (one copy)", "memcpy")):
            desc = "1" if key == "memcpy" else str(sc["descriptors_per_transfer"])
            print(f"{name:<12}{label:<34}{desc:>12}{sc[key + '_ms']:>10.2f}{sc[key + '_gbps']:>10.2f}")
    print(f"planning a 128k-token request over 61 MLA layers: {res['plan_128k_tokens_61_layers_ms']:.1f} ms "
          f"({res['plan_128k_descriptors']} descriptors)")
    print(f"idle servers: prefill {res['idle_cpu_percent_prefill']:.1f} % CPU, decode "
          f"{res['idle_cpu_percent_decode']:.1f} % CPU; UCX: {', '.join(res['ucx_transports'])}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if res["verified"] else 1
