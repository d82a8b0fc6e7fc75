"""A long-uptime soak: many transfers through one D server, its P restarted again and again.

    .venv/bin/python -m benchmarks.soak --transfers 250000 --fault-every 10000 --json benchmarks/soak.json
    (make soak)

An engine-shaped client (one TransferStream to D, 32 transfers in flight, each in its own
pair of blocks) moves stamped blocks from P to D and checks every one that answered OK:
D's block must hold exactly the stamp just written into P's, so a transfer that read
another request's bytes, or stale ones, is counted as wrong. Every `fault_every` transfers
P is restarted on the same address -- killed (SIGKILL) and stopped gracefully (SIGTERM) in
turn -- while transfers are in flight; D is never restarted. Measured: wrong bytes (must be
0), typed failures by reason (each fault costs the transfers in flight), untyped failures
(must be 0), how long after P listens again a new transfer succeeds (the goal: within 2 s),
and D's RSS, open fds and threads after each segment (they must stay flat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.errors import KvsvcError
from tests.e2e.harness import Engine

LAYOUT = {"model_id": "kvsvc-soak", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 64,
          "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2,
                                           "head_size": 64}]}
IN_FLIGHT = 32  # slot i moves P block i into D block i: no two transfers share a block
TRANSFER_TIMEOUT_S = 10.0
RECOVERY_GOAL_S = 2.0


def proc_stats(pid: int) -> dict[str, int]:
    field = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_kib": int(field["VmRSS"].split()[0]), "threads": int(field["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def stamp(n: int) -> np.ndarray:
    return np.frombuffer(n.to_bytes(8, "little"), dtype=np.uint8)


def write_block(engine: Engine, block: int, n: int) -> None:
    mem = engine.mem[0]
    for r in mem.regions:
        start = r.pool_offset + block * r.block_stride
        mem.buf[start:start + r.block_len] = np.resize(stamp(n), r.block_len)


def holds(engine: Engine, block: int, n: int) -> bool:
    mem = engine.mem[0]
    return all(np.array_equal(np.asarray(mem.buf[r.pool_offset + block * r.block_stride:][:r.block_len]),
                              np.resize(stamp(n), r.block_len)) for r in mem.regions)


class Soak:
    def __init__(self, total: int, fault_every: int) -> None:
        self.total, self.fault_every = total, fault_every
        self.next = 0
        self.ok = 0
        self.wrong = 0
        self.typed: Counter[str] = Counter()
        self.untyped: Counter[str] = Counter()
        self.recoveries: list[float] = []
        self.segments: list[dict[str, Any]] = []
        self.p: ServerProcess | None = None
        self.address = ""

    def start_p(self) -> None:
        self.p = start_server(engine_id="soak-p", role="prefill", tp_size=1, layout=LAYOUT,
                              listen=self.address or "127.0.0.1:0")
        self.address = self.p.address

    async def run(self) -> dict[str, Any]:
        self.start_p()
        d = start_server(engine_id="soak-d", role="decode", tp_size=1, layout=LAYOUT)
        t0 = time.monotonic()
        try:
            async with AsyncClient(d.address) as dc:
                de = await Engine.of(dc)
                channel = dc.transfer_stream()
                try:
                    faults = 0
                    while self.next < self.total:
                        segment_end = min(self.total, self.next + self.fault_every)
                        await self.segment(channel, de, segment_end)
                        self.segments.append({"transfers": self.next, **proc_stats(d.proc.pid)})
                        print(json.dumps({**self.segments[-1], "ok": self.ok, "wrong": self.wrong,
                                          "typed": sum(self.typed.values()), "untyped": sum(self.untyped.values())}),
                              flush=True)
                        if self.next < self.total:
                            faults += 1
                            await self.fault(channel, de, kill=faults % 2 == 1)
                finally:
                    await channel.close()
                    de.close()
        finally:
            d.stop()
            if self.p is not None:
                self.p.stop()
        first, middle, last = self.segments[0], self.segments[len(self.segments) // 2], self.segments[-1]
        return {
            "transfers": self.total, "fault_every": self.fault_every, "faults": len(self.recoveries),
            "seconds": round(time.monotonic() - t0, 1), "ok": self.ok, "wrong_bytes": self.wrong,
            "typed_failures": dict(self.typed), "untyped_failures": dict(self.untyped),
            "recovery_s_max": round(max(self.recoveries, default=0.0), 3),
            "recovery_s_p50": round(sorted(self.recoveries)[len(self.recoveries) // 2], 3) if self.recoveries else 0.0,
            "d_growth_after_first_segment": {k: last[k] - first[k] for k in ("rss_kib", "threads", "fds")},
            # D remembers finished transfers for 300 s, up to 100,000 (docs/SECURITY.md): its RSS
            # grows until that history is full, then stays; the second half shows the steady state.
            "d_growth_second_half": {k: last[k] - middle[k] for k in ("rss_kib", "threads", "fds")},
            "segments": self.segments,
        }

    async def segment(self, channel: Any, de: Engine, end: int) -> None:
        """Transfers up to number `end`, IN_FLIGHT at a time, against the running P."""
        async with AsyncClient(self.address, ClientOptions(retries=0)) as pc:
            pe = await Engine.of(pc)
            try:
                await asyncio.gather(*(self.slot(i, channel, pc, pe, de, end) for i in range(IN_FLIGHT)))
            finally:
                pe.close()

    async def slot(self, block: int, channel: Any, pc: AsyncClient, pe: Engine, de: Engine, end: int) -> None:
        while self.next < end:
            n = self.next
            self.next += 1
            await self.one(n, block, channel, pc, pe, de)

    async def one(self, n: int, block: int, channel: Any, pc: AsyncClient, pe: Engine, de: Engine) -> bool:
        write_block(pe, block, n)
        try:
            pub = await pc.publish_blocks(f"s{n}", [[block]])
            await channel.transfer(f"d-s{n}", pub.params, [[block]], timeout_s=TRANSFER_TIMEOUT_S)
        except KvsvcError as e:
            self.typed[str(getattr(e.reason, "value", e.reason))] += 1
            return False
        except Exception as e:  # counted: the soak's point is that there are none
            self.untyped[type(e).__name__] += 1
            return False
        if holds(de, block, n):
            self.ok += 1
            return True
        self.wrong += 1
        return False

    async def fault(self, channel: Any, de: Engine, *, kill: bool) -> None:
        """Restart P on its address while transfers are in flight; then time the first success."""
        assert self.p is not None
        async with AsyncClient(self.address, ClientOptions(retries=0)) as pc:
            pe = await Engine.of(pc)
            try:
                flying = [asyncio.ensure_future(self.one(self.next + i, i, channel, pc, pe, de))
                          for i in range(IN_FLIGHT)]
                self.next += IN_FLIGHT
                await asyncio.sleep(0)  # their publishes are on their way
                if kill:
                    self.p.kill()
                await asyncio.to_thread(self.p.stop)  # graceful; or, killed, its pipe closed
                await asyncio.gather(*flying)
            finally:
                pe.close()
        self.start_p()
        listening = time.monotonic()
        async with AsyncClient(self.address, ClientOptions(retries=0)) as pc:
            pe = await Engine.of(pc)
            try:
                while not await self.one(self.next, 0, channel, pc, pe, de):
                    self.next += 1
                self.next += 1
            finally:
                pe.close()
        self.recoveries.append(time.monotonic() - listening)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", type=int, default=250_000)
    ap.add_argument("--fault-every", type=int, default=10_000)
    ap.add_argument("--json", help="write the results here")
    opts = ap.parse_args()
    results = asyncio.run(Soak(opts.transfers, opts.fault_every).run())
    summary = {k: v for k, v in results.items() if k != "segments"}
    print(json.dumps(summary, indent=1))
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1) + "\n")
    good = (not results["wrong_bytes"] and not results["untyped_failures"]
            and results["recovery_s_max"] <= RECOVERY_GOAL_S)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
