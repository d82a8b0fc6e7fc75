"""How fast a vLLM P engine's embedded kvsvc server answers lease calls, idle and busy.

    .venv-vllm/bin/python -m benchmarks.vllm_embedded --json benchmarks/vllm-embedded.json   (part of make bench-vllm)

A D engine's transfer ends with a lease call to the P worker's embedded server (claim and
consume); that server runs on its own thread and event loop inside vLLM's worker process,
next to the model's forward passes and vLLM's own waiting for the next step. This starts
one P engine (`vllm serve`, TP 1, KvsvcConnector, the tests' random-weight Llama), finds
its server in the log, and times lease calls on it (a HEARTBEAT for a lease it does not
hold: answered by the lease table, the same path and loop a claim takes), one at a time,
10 ms apart: first with the engine idle between steps, then while it prefills a steady
stream of 1,024-token prompts (4 in flight). Reports p50, p99 and max in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from kvsvc.client import AsyncClient
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.vllm.engines import KVSVC, kvsvc_servers, write_model
from tests.vllm.served import completion, vllm_serve


async def time_calls(address: str, count: int, gap_s: float) -> list[float]:
    async with AsyncClient(address) as client:
        epoch = (await client.get_info()).epoch
        call = pb.NotifyRequest(request_id="bench-probe", kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id="bench",
                                tp_size=1, lease_epoch=epoch, lease_token="0" * 32)
        for _ in range(10):  # the channel is open and warm
            await client.notify(call)
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            await client.notify(call, timeout_s=30)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(gap_s)
        return out


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    n = len(ordered)
    return {"p50_ms": round(1e3 * ordered[n // 2], 3), "p99_ms": round(1e3 * ordered[min(n - 1, (99 * n) // 100)], 3),
            "max_ms": round(1e3 * ordered[-1], 3), "calls": n}


def keep_busy(url: str, stop: threading.Event, counter: list[int]) -> None:
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        prompt = [rng.randrange(1, 500) for _ in range(1024)]
        try:
            requests.post(url + "/v1/completions", json=completion(prompt, 1), timeout=300)
            counter[0] += 1
        except requests.RequestException:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-embedded-") as tmp:
        base = Path(tmp)
        write_model(base / "model", max_positions=2048)
        p = vllm_serve("p", base / "model", base, dict(KVSVC, kv_role="kv_producer"),
                       extra_args=("--max-model-len", "1100"))
        try:
            p.wait_ready()
            (address,) = kvsvc_servers(p.log)
            time.sleep(2)  # the engine settles into its idle wait
            results["idle"] = summary(asyncio.run(time_calls(address, args.calls, 0.01)))
            print(f"idle: {results['idle']}", file=sys.stderr)
            stop, done = threading.Event(), [0]
            load = [threading.Thread(target=keep_busy, args=(p.url, stop, done), daemon=True) for _ in range(4)]
            for t in load:
                t.start()
            time.sleep(3)  # prefills running
            results["busy"] = summary(asyncio.run(time_calls(address, args.calls, 0.01)))
            stop.set()
            for t in load:
                t.join(300)
            results["busy"]["prefills_during"] = done[0]
            print(f"busy: {results['busy']}", file=sys.stderr)
        finally:
            p.stop()
    print(f"\nlease calls on a vLLM P engine's embedded kvsvc server, {args.calls} each, 10 ms apart")
    print(f"{'':10}{'p50 (ms)':>10}{'p99 (ms)':>10}{'max (ms)':>10}")
    for name in ("idle", "busy"):
        r = results[name]
        print(f"{name:10}{r['p50_ms']:>10}{r['p99_ms']:>10}{r['max_ms']:>10}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
