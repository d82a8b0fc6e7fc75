"""What a memory order costs: the same request between TP sizes with HND, NHD and mixed blocks.

    .venv/bin/python -m benchmarks.layouts --json benchmarks/layouts.json      (make bench-layouts)

A P server of TP 2 and a D server of TP 1 (and the reverse), real processes, the bench
model of `kvsvc bench` (8 KV heads of 128, bf16, blocks of 16 tokens, 4 layers). D's rank
reads heads from P's ranks: under HND a head of a block is one run, under NHD (heads
inside each token) a token's run of heads is, and where the orders differ one head of one
token is. Side by side for each: kvsvc's Transfer (p50), its descriptors, the plan of the
request alone (in this process), and memcpy of the same bytes. Equal TP NHD (whole blocks)
is the control.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from kvsvc.bench.measure import gbps, ms
from kvsvc.bench.paths import kvsvc_sequential, memcpy_runs
from kvsvc.bench.sweep import bench_layout
from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.layout import layout_from_dict
from kvsvc.mapping import Side, plan_rank

LAYERS, NUM_BLOCKS, REQUEST_BLOCKS = 4, 256, 64  # 64 blocks of 16 tokens: 1,024 tokens

# (name, P TP, D TP, P order, D order)
CASES = [
    ("HND p2->d1", 2, 1, "HND", "HND"),
    ("NHD p2->d1", 2, 1, "NHD", "NHD"),
    ("NHD->HND p2->d1", 2, 1, "NHD", "HND"),
    ("HND p1->d2", 1, 2, "HND", "HND"),
    ("NHD p1->d2", 1, 2, "NHD", "NHD"),
    ("NHD p2->d2 (whole blocks)", 2, 2, "NHD", "NHD"),
]


def table(order: str) -> dict[str, Any]:
    return {**bench_layout(LAYERS, NUM_BLOCKS), "kv_memory_layout": order}


def plan_ms(p_tp: int, d_tp: int, p_order: str, d_order: str, ids: list[int], runs: int = 20) -> float:
    """The plan of one D rank for the request, computed here as D's server computes it."""
    local = Side.of(layout_from_dict(table(d_order), d_tp), d_tp)
    remote = Side.of(layout_from_dict(table(p_order), p_tp), p_tp)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plan_rank(local, remote, 0, [ids], [ids])
        times.append(time.perf_counter() - t0)
    return ms(times, 50)


async def one_case(name: str, p_tp: int, d_tp: int, p_order: str, d_order: str, runs: int) -> dict[str, Any]:
    p = start_server(engine_id="bench-p", role="prefill", tp_size=p_tp, layout=table(p_order))
    d = start_server(engine_id="bench-d", role="decode", tp_size=d_tp, layout=table(d_order))
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            rng = np.random.default_rng(3)
            p_ids = [int(x) for x in rng.permutation(NUM_BLOCKS)[:REQUEST_BLOCKS]]
            d_ids = [int(x) for x in rng.permutation(NUM_BLOCKS)[:REQUEST_BLOCKS]]
            s = await kvsvc_sequential(pc, dc, p_ids, d_ids, runs, name.replace(" ", "-"))
    finally:
        d.stop()
        p.stop()
    copy = memcpy_runs(s.nbytes, runs)
    p50 = ms(s.transfer, 50) / 1e3
    return {"case": name, "p_tp": p_tp, "d_tp": d_tp, "p_order": p_order, "d_order": d_order,
            "bytes": s.nbytes, "descriptors": s.descriptors, "transfer_p50_ms": ms(s.transfer, 50),
            "wire_p50_ms": ms(s.wire, 50), "kvsvc_gbps": gbps(s.nbytes, p50),
            "memcpy_p50_ms": ms(copy, 50), "memcpy_gbps": gbps(s.nbytes, ms(copy, 50) / 1e3),
            "plan_p50_ms": plan_ms(p_tp, d_tp, p_order, d_order, sorted(d_ids))}


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = ["case", "MiB", "descriptors", "Transfer p50 ms", "wire p50 ms", "kvsvc GB/s", "memcpy GB/s", "plan ms"]
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([r["case"], f"{r['bytes'] / 2**20:.0f}", f"{r['descriptors']:,}", f"{r['transfer_p50_ms']:.2f}",
                          f"{r['wire_p50_ms']:.2f}", f"{r['kvsvc_gbps']:.2f}", f"{r['memcpy_gbps']:.2f}",
                          f"{r['plan_p50_ms']:.2f}"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--runs", type=int, default=10, help="timed transfers per case (default 10)")
    args = ap.parse_args(argv)
    rows = []
    for case in CASES:
        rows.append(asyncio.run(one_case(*case, args.runs)))
        print(f"benchmarks.layouts: {case[0]} done", file=sys.stderr, flush=True)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": LAYERS, "request_blocks": REQUEST_BLOCKS, "block_tokens": 16, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
