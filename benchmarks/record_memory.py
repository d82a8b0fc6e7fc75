"""What a finished transfer costs a D server's memory, measured as the process's RSS.

    .venv/bin/python -m benchmarks.record_memory --json benchmarks/record-memory.json

A D server remembers every finished transfer for a while (WaitTransfer answers it; the
limits are in docs/SECURITY.md): 100,000 records, 64 MiB or 300 s. What one record costs
was estimated from its fields and measured with tracemalloc in a unit test; neither sees
memory outside Python's allocator (NIXL's, UCX's, the allocator's own). Here real P and D
server processes move 1,000-block requests, and D's VmRSS is read before and after a
batch of each kind, all kept (well inside the limits):

- "failed": the lease was released before D claimed it (aborted with its token, as a
  router that gives a request up does; an expired lease takes the same path) -- D read the
  blocks, P refused the claim (LEASE_EXPIRED), D answers with TransferFailure;
- "succeeded": the same requests with a live lease (the control).

Beside each figure: D's own estimate of what its records cost (the gauge
kvsvc_transfer_record_bytes, on which the 64 MiB bound is kept), so that the bound can be
checked against what the process spends (tests/e2e/test_record_memory.py does).

Batches alternate (failed, succeeded, failed, ...), each after a warm-up of both kinds, so
that a growth of the heap that is not per record shows in both. The figure is the RSS
growth per transfer of a batch; the JSON has every batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.client.leases import abort_published
from kvsvc.errors import KvsvcError

BLOCKS = 1000  # per request, as in the probe round
LAYOUT = {"model_id": "kvsvc-records", "total_num_kv_heads": 1, "block_size": 16, "num_blocks": BLOCKS,
          "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": 1,
                                           "head_size": 16}]}
IN_FLIGHT = 16


def record_bytes(metrics_url: str) -> float:
    """D's estimate of what its remembered transfers cost (kvsvc_transfer_record_bytes)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r"^kvsvc_transfer_record_bytes\{[^}]*\} (\S+)$", text, re.M)
    if m is None:
        raise RuntimeError("D serves no kvsvc_transfer_record_bytes")
    return float(m.group(1))


def metrics_url(output: list[str]) -> str:
    for line in output:
        m = re.search(r"kvsvc metrics on (http://\S+/metrics)", line)
        if m:
            return m.group(1)
    raise RuntimeError("D printed no metrics address")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def batch(pc: AsyncClient, dc: AsyncClient, kind: str, start: int, n: int) -> int:
    """n transfers of `kind` ("failed": expired leases; "succeeded"); returns how many failed."""
    ids = [list(range(BLOCKS))]
    failed = 0
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        nonlocal failed
        async with sem:
            rid = f"{kind}-{start + i}"
            pub = await pc.publish_blocks(rid, ids)
            if kind == "failed":  # released before D's claim: P refuses it after D's READs
                assert (await abort_published(pub.params, channels={pc.address: pc})) == {
                    pc.address: "LEASE_STATE_ABORTED"}
            try:
                await dc.transfer(f"d-{rid}", pub.params, ids, timeout_s=60)
            except KvsvcError as e:
                if kind != "failed" or e.reason != "LEASE_EXPIRED":
                    raise
                failed += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return failed


async def main(n: int, rounds: int) -> dict:
    cfg = Path(tempfile.mkdtemp(prefix="kvsvc-records-")) / "d.toml"
    cfg.write_text('[server]\nmetrics_listen = "127.0.0.1:0"\n')
    p = start_server(engine_id="rec-p", role="prefill", tp_size=1, layout=LAYOUT)
    d = start_server(engine_id="rec-d", role="decode", tp_size=1, layout=LAYOUT, config_file=str(cfg))
    pid, url = d.proc.pid, metrics_url(d.output)
    batches = []
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            for kind in ("succeeded", "failed"):  # warm-up: peers, agents, pools, arenas
                await batch(pc, dc, kind, 10**6, n // 4)
            seq = 0
            for r in range(rounds):
                for kind in ("failed", "succeeded"):
                    before, estimated_before = rss_kib(pid), record_bytes(url)
                    t0 = time.perf_counter()
                    failed = await batch(pc, dc, kind, seq, n)
                    seq += n
                    after, estimated_after = rss_kib(pid), record_bytes(url)
                    batches.append({"round": r, "kind": kind, "transfers": n, "failed": failed,
                                    "rss_before_kib": before, "rss_after_kib": after,
                                    "kib_per_transfer": round((after - before) / n, 2),
                                    "estimated_kib_per_transfer": round((estimated_after - estimated_before) / n
                                                                        / 1024, 2),
                                    "seconds": round(time.perf_counter() - t0, 2)})
                    print(json.dumps(batches[-1]), flush=True)
    finally:
        d.stop()
        p.stop()

    def median(kind: str) -> float:
        vals = sorted(b["kib_per_transfer"] for b in batches if b["kind"] == kind)
        return vals[len(vals) // 2]

    return {"blocks_per_request": BLOCKS, "transfers_per_batch": n, "batches": batches,
            "median_kib_per_failed": median("failed"), "median_kib_per_succeeded": median("succeeded"),
            "estimated_kib_per_failed": max(b["estimated_kib_per_transfer"] for b in batches if b["kind"] == "failed"),
            "estimated_kib_per_succeeded": max(b["estimated_kib_per_transfer"] for b in batches
                                               if b["kind"] == "succeeded")}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", type=int, default=2000, help="transfers per batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    opts = ap.parse_args()
    results = asyncio.run(main(opts.transfers, opts.rounds))
    print(f"D's RSS per kept record: failed {results['median_kib_per_failed']} KiB "
          f"(estimated {results['estimated_kib_per_failed']}), succeeded {results['median_kib_per_succeeded']} KiB "
          f"(estimated {results['estimated_kib_per_succeeded']}); median of {opts.rounds} batches of "
          f"{opts.transfers}, {BLOCKS}-block requests")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1) + "\n")
    sys.exit(0)
