"""Progressive pull against pull-after-prefill, across two simulated hosts (tests/hosts).

    sudo .venv/bin/python -m benchmarks.progressive --json benchmarks/progressive.json   (needs root)

P's server runs on host a, D's on host b (veth pairs on a bridge: the kernel's TCP stack, UCX
over TCP). This process plays both engines: P's computes a prompt chunk by chunk (each chunk
takes the time a prefill rate gives it: a sleep, so that the servers have the CPU a GPU
engine would leave them) and D's asks its server to load the request:

- whole: P leases the request after its last chunk, then D's Transfer reads it (today's pull);
- progressive: P opens a progressive lease at its first chunk and commits each later one; D's
  Transfer starts at the open and reads each chunk while P computes the next.

The figure is the handover tail: from P's last chunk computed to D's blocks loaded. Its
part hidden behind prefill is 1 - tail(progressive) / tail(whole). One request at a time;
each prompt length and mode run interleaved, `--runs` times. One progressive transfer is
checked byte for byte at the end. What this does not show: an engine's own step loop
(dispatch, admission, completion polling) around the transfer -- that needs the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.hosts import bench_pair
from kvsvc.bench.sweep import bench_layout, block_bytes_of
from kvsvc.client import AsyncClient
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine
from tests.hosts.harness import Host, available

BLOCK_TOKENS = 16  # bench_layout's


def ids(blocks: range) -> list[pb.BlockIds]:
    return [pb.BlockIds(block_ids=list(blocks))]


async def one(pc: AsyncClient, dc: AsyncClient, rid: str, tokens: int, chunk_tokens: int, chunk_s: float,
              progressive: bool) -> float:
    """One request: its handover tail in seconds (P's last chunk computed -> D loaded)."""
    bounds = [*range(0, tokens, chunk_tokens), tokens]
    chunks = [range(a // BLOCK_TOKENS, math.ceil(b / BLOCK_TOKENS)) for a, b in itertools.pairwise(bounds)]
    # A chunk that ends inside a block: that block is P's next chunk's too (committed whole with it).
    for i in range(len(chunks) - 1):
        if bounds[i + 1] % BLOCK_TOKENS:
            chunks[i] = range(chunks[i].start, chunks[i].stop - 1)
            chunks[i + 1] = range(chunks[i].stop, chunks[i + 1].stop)
    d_blocks = [list(range(math.ceil(tokens / BLOCK_TOKENS)))]
    if not progressive or len(chunks) == 1:
        for _ in chunks:
            await asyncio.sleep(chunk_s)
        last = time.perf_counter()
        pub = await pc.publish_blocks(rid, [list(range(chunks[-1].stop))], num_tokens=tokens)
        await dc.transfer("d-" + rid, pub.params, d_blocks, timeout_s=300)
        return time.perf_counter() - last
    await asyncio.sleep(chunk_s)
    opened = await pc.publish_blocks_request(pb.PublishBlocksRequest(
        request_id=rid, block_ids_per_group=ids(chunks[0]), num_tokens=bounds[1] // BLOCK_TOKENS * BLOCK_TOKENS,
        progressive=True))
    moving = asyncio.ensure_future(dc.transfer("d-" + rid, opened.params, d_blocks, timeout_s=300))
    for epoch, (chunk, end) in enumerate(zip(chunks[1:], bounds[2:], strict=True), start=2):
        await asyncio.sleep(chunk_s)
        final = end == tokens
        last = time.perf_counter()
        await pc.commit_blocks(pb.CommitBlocksRequest(
            request_id=rid, lease_token=opened.params.lease_token, commit_epoch=epoch, block_ids_per_group=ids(chunk),
            num_tokens=end if final else end // BLOCK_TOKENS * BLOCK_TOKENS, final=final))
    await moving
    return time.perf_counter() - last


async def measure(p_addr: str, d_addr: str, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.tokens.split(",")]
    chunk_s = args.chunk_tokens / args.prefill_tokens_per_s
    tails: dict[str, dict[str, list[float]]] = {str(n): {"whole": [], "progressive": []} for n in lengths}
    async with AsyncClient(p_addr) as pc, AsyncClient(d_addr) as dc:
        for n in lengths:  # warm-up: handshake, first touch of the pages
            await one(pc, dc, f"warm-{n}", n, args.chunk_tokens, 0.0, False)
        for run in range(args.runs):
            for n in lengths:
                for mode in ("whole", "progressive") if run % 2 == 0 else ("progressive", "whole"):
                    tail = await one(pc, dc, f"{mode}-{n}-{run}", n, args.chunk_tokens, chunk_s, mode == "progressive")
                    tails[str(n)][mode].append(tail)
    rows = {}
    for n, by_mode in tails.items():
        whole, prog = statistics.median(by_mode["whole"]), statistics.median(by_mode["progressive"])
        rows[n] = {"tail_ms_whole_p50": 1e3 * whole, "tail_ms_progressive_p50": 1e3 * prog,
                   "tail_ms_whole_max": 1e3 * max(by_mode["whole"]),
                   "tail_ms_progressive_max": 1e3 * max(by_mode["progressive"]),
                   "hidden_fraction": 1 - prog / whole if whole else None,
                   "prefill_ms": 1e3 * int(n) / args.prefill_tokens_per_s,
                   "mib": int(n) / BLOCK_TOKENS * block_bytes_of(args.layers) / (1 << 20)}
    return rows


async def verify(p_addr: str, d_addr: str, a: Host, b: Host) -> bool:
    """One progressive transfer of a 3-chunk request, D's bytes compared with P's."""
    async with AsyncClient(p_addr) as pc, AsyncClient(d_addr) as dc:
        pe, de = await Engine.of(pc, a.shm_dir), await Engine.of(dc, b.shm_dir)
        try:
            pe.fill([list(range(48))])
            await one(pc, dc, "verify", 48 * BLOCK_TOKENS, 16 * BLOCK_TOKENS, 0.0, True)
            return not de.check([list(range(48))])
        finally:
            pe.close()
            de.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = available()
    if reason:
        raise SystemExit(f"benchmarks.progressive: {reason}")
    most = max(int(x) for x in args.tokens.split(","))
    layout = bench_layout(args.layers, math.ceil(most / BLOCK_TOKENS) + 8)
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    with bench_pair(layout, env) as (a, b, p, d):
        rows = asyncio.run(measure(p.address, d.address, args))
        verified = asyncio.run(verify(p.address, d.address, a, b))
    return {"link": "veth pairs on a Linux bridge (network namespaces), UCX " + (args.ucx_tls or "default"),
            "kv_bytes_per_token": block_bytes_of(args.layers) // BLOCK_TOKENS, "chunk_tokens": args.chunk_tokens,
            "prefill_tokens_per_s": args.prefill_tokens_per_s, "runs": args.runs, "in_flight": 1,
            "cpu_count": os.cpu_count(), "by_prompt_tokens": rows, "verified": verified}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="P's prefill chunk")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0,
                    help="P's simulated prefill rate (the chunk's compute time is a sleep)")
    ap.add_argument("--layers", type=int, default=8, help="bench layout layers (8: 32 KiB of KV a token)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for both servers (tcp: as between hosts without RDMA)")
    args = ap.parse_args(argv)
    res = run(args)
    print(f"{'tokens':>7} {'MiB':>6} {'prefill ms':>10} {'tail whole p50':>15} {'tail progressive p50':>21} "
          f"{'hidden':>7}")
    for n, r in res["by_prompt_tokens"].items():
        print(f"{n:>7} {r['mib']:>6.0f} {r['prefill_ms']:>10.0f} {r['tail_ms_whole_p50']:>12.1f} ms "
              f"{r['tail_ms_progressive_p50']:>18.1f} ms {100 * (r['hidden_fraction'] or 0):>6.0f}%")
    print(f"bytes checked: {res['verified']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
