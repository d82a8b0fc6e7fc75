"""SGLang's transfer backends across two simulated hosts, placed alike: kvsvc (pulled), kvsvc
streamed (KVSVC_SGLANG_PROGRESSIVE on P) and SGLang's own NIXL backend.

    sudo .venv-sglang/bin/python -m benchmarks.sglang_placed --json benchmarks/sglang-placed.json   (make bench-sglang-placed)

P runs on host a and D on host b (tests/hosts: own network namespace, /dev/shm and temp dir,
joined by a veth bridge), so the KV crosses a real kernel TCP path (UCX over TCP), as between
nodes without RDMA; the model is vllm_stream's (16 KiB of KV a token) and P prefills in chunks
of --chunk tokens. This process is the load balancer: like SGLang's router it posts each
request to P and D at once, with P's bootstrap address and a room of its own, and times D's
first streamed token (TTFT) and P's answer (which SGLang gives once P's side of the transfer
ended: not a prefill time).

Fair by construction, as benchmarks/vllm_stream.py: the same server arguments for every
backend, P pinned to CPU 0 and D to CPU 1 (taskset on the whole process tree, every thread
pinned again after the first transfer and checked after the run), backends run in turn, new
prompts for every batch, both radix caches flushed before each batch (a flush succeeds only on
an idle server: it is the check that nothing is held), CPU seconds counted per server process
tree. TTFT p50 and max per cell (the max stands in for a p99: too few samples for one).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from benchmarks.vllm_pd import cpu_seconds
from benchmarks.vllm_stream import cannot_place, off_cpu, pin, write_bench_model
from tests.hosts.harness import Host, hosts
from tests.sglang.served import CPU_ENV, kvsvc_servers, metric
from tests.vllm.served import Served

PORT = 8000
BOOTSTRAP_PORT = 8998
BACKENDS = {"kvsvc": ("kvsvc", {}), "kvsvc-stream": ("kvsvc", {"KVSVC_SGLANG_PROGRESSIVE": "true"}),
            "nixl": ("nixl", {})}


def serve(host: Host, name: str, cpu: int, model: str, mode: str, backend: str, env: dict[str, str], logs: Path,
          max_total_tokens: int, chunk: int) -> Served:
    argv = [*host.launcher, "taskset", "-c", str(cpu), sys.executable, "-m", "sglang.launch_server",
            "--model-path", model, "--host", host.address, "--port", str(PORT), "--device", "cpu",
            "--max-total-tokens", str(max_total_tokens), "--chunked-prefill-size", str(chunk), "--random-seed", "0",
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend, "--skip-tokenizer-init"]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    else:
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return Served(name, argv, logs, PORT, {**CPU_ENV, "SGLANG_HOST_IP": host.address, **env}, host=host.address)


def flush(*servers: Served) -> None:
    """Empty both radix caches; SGLang refuses while a request or a transfer is still held."""
    for s in servers:
        deadline = time.monotonic() + 120
        while requests.post(s.url + "/flush_cache", timeout=60).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{s.name} could not flush its cache: something is still held")
            time.sleep(0.5)


def body(ids: list[int], max_tokens: int, p: Served, room: int, stream: bool) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream, "bootstrap_host": p.url.split("//")[1].split(":")[0],
            "bootstrap_port": BOOTSTRAP_PORT, "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def first_token(url: str, req: dict[str, Any], t0: float) -> tuple[float, list[int]]:
    """(seconds from t0 to the first token SGLang streams at url, every token id)."""
    first, out = None, []
    with requests.post(url + "/generate", json=req, stream=True, timeout=1200) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                got = json.loads(line[6:]).get("output_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                out = got
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first, out


def one(p: Served, d: Served, ids: list[int], max_tokens: int, rng: random.Random) -> dict[str, Any]:
    room = rng.randrange(1, 2**62)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        on_d = pool.submit(first_token, d.url, body(ids, max_tokens, p, room, True), t0)
        r = requests.post(p.url + "/generate", json=body(ids, max_tokens, p, room, False), timeout=1200)
        if r.status_code != 200:
            raise RuntimeError(f"{p.name}: HTTP {r.status_code}: {r.text[:300]}")
        p_done = time.perf_counter() - t0
        ttft, tokens = on_d.result()
    if len(tokens) != max_tokens:
        raise RuntimeError(f"{d.name} answered {len(tokens)} tokens, not {max_tokens}")
    return {"ttft": ttft, "p_done": p_done}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    for key in ("ttft", "p_done"):
        values = sorted(s[key] for s in samples)
        out[f"{key}_ms_p50"] = round(1e3 * statistics.median(values), 1)
        out[f"{key}_ms_max"] = round(1e3 * values[-1], 1)
    return out


def run_backend(name: str, a: Host, b: Host, logs: Path, batches: list[tuple[str, list[list[int]]]],
                args: argparse.Namespace) -> dict[str, Any]:
    backend, env = BACKENDS[name.removesuffix("-again")]
    if backend == "kvsvc":  # the embedded servers' own metrics, where this process can read them
        for h in (a, b):
            h.write(f"{h.tmp}/kvsvc.toml", f'[server]\nmetrics_listen = "{h.address}:0"\n')
        env = {**env, "KVSVC_SGLANG_CONFIG": f"{a.tmp}/kvsvc.toml"}  # the same path on each host
    p = serve(a, f"{name}-p", 0, f"{a.tmp}/model", "prefill", backend, env, logs, args.max_total_tokens, args.chunk)
    d = serve(b, f"{name}-d", 1, f"{b.tmp}/model", "decode", backend, env, logs, args.max_total_tokens, args.chunk)
    rng = random.Random(name)
    try:
        p.wait_ready(900)
        d.wait_ready(900)
        one(p, d, [rng.randrange(1, 500) for _ in range(256)], 2, rng)  # first contact: bootstrap, handshakes
        moved = {"p": pin(p, 0), "d": pin(d, 1)}  # after the first transfer: its threads exist now
        cpu0, kv0 = (cpu_seconds(p), cpu_seconds(d)), kvsvc_figures(d)
        samples: dict[str, list[dict[str, Any]]] = {}
        for cell, prompts in batches:
            flush(p, d)
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda ids: one(p, d, ids, args.max_tokens, random.Random(rng.random())), prompts))
            samples.setdefault(cell, []).extend(got)
            print(f"  {name}: {cell}: {summary(got)}", file=sys.stderr)
        cpu1, kv1 = (cpu_seconds(p), cpu_seconds(d)), kvsvc_figures(d)
        n = sum(len(v) for v in samples.values())
        kv = {k: kv1[k] - kv0[k] for k in kv1}
        return {"cells": {k: summary(v) for k, v in samples.items()},
                "samples": {k: [{x: round(y, 4) for x, y in s.items()} for s in v] for k, v in samples.items()},
                "threads_repinned": moved, "threads_off_cpu_after": {"p": off_cpu(p, 0), "d": off_cpu(d, 1)},
                "kvsvc": {"transfers": int(kv["count"]),
                          "transfer_ms_mean": round(1e3 * kv["sum"] / kv["count"], 2) if kv["count"] else None,
                          "wire_ms_mean": round(1e3 * kv["wire_sum"] / kv["count"], 2) if kv["count"] else None,
                          "chunks_read_growing": int(kv["growing"]), "chunks_read_final": int(kv["final"]),
                          "after_final_ms_mean": round(1e3 * kv["after_sum"] / kv["after_count"], 2)
                          if kv["after_count"] else None}
                if backend == "kvsvc" else None,
                "p_cpu_s_per_request": round((cpu1[0] - cpu0[0]) / n, 3),
                "d_cpu_s_per_request": round((cpu1[1] - cpu0[1]) / n, 3)}
    finally:
        p.stop()
        d.stop()


def kvsvc_figures(d: Served) -> dict[str, float]:
    """D's embedded kvsvc servers so far (zeros under SGLang's own backend): transfers, their
    time and wire time, chunks read while P still prefilled (growing) or after (final), and a
    streamed transfer's time after D heard of P's final commit (what streaming did not hide)."""
    out = dict.fromkeys(("sum", "count", "wire_sum", "growing", "final", "after_sum", "after_count"), 0.0)
    for _, url in kvsvc_servers(d).values():
        if url:
            out["sum"] += metric(url, "kvsvc_transfer_seconds_sum")
            out["count"] += metric(url, "kvsvc_transfer_seconds_count")
            out["wire_sum"] += metric(url, "kvsvc_transfer_wire_seconds_sum")
            out["growing"] += metric(url, "kvsvc_progressive_reads_total", when="growing")
            out["final"] += metric(url, "kvsvc_progressive_reads_total", when="final")
            out["after_sum"] += metric(url, "kvsvc_progressive_after_final_seconds_sum")
            out["after_count"] += metric(url, "kvsvc_progressive_after_final_seconds_count")
    return out


def table(results: dict[str, Any], cells: list[str], backends: list[str]) -> str:
    names = sorted({n.removesuffix("-again") for n in backends}, key=list(BACKENDS).index)
    rows = [f"| prompt x in flight | {' | '.join(f'TTFT p50 (max): {n}' for n in names)} |",
            "|---|" + "---|" * len(names)]
    for cell in cells:
        parts = []
        for n in names:
            got = [s["ttft"] for k, r in results.items() if k.removesuffix("-again") == n
                   for s in r["samples"].get(cell, ())]
            parts.append(f"{1e3 * statistics.median(got):.0f} ({1e3 * max(got):.0f}) ms" if got else "--")
        rows.append(f"| {cell} | {' | '.join(parts)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["1024x1", "1024x8", "4096x1", "4096x8"],
                    metavar="LENGTHxINFLIGHT")
    ap.add_argument("--rounds", type=int, default=2, help="batches of each cell, per backend")
    ap.add_argument("--chunk", type=int, default=512, help="P's prefill chunk (--chunked-prefill-size)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--backends", nargs="+", default=["kvsvc", "kvsvc-stream", "nixl", "kvsvc-again"],
                    help=f"in order, from {sorted(BACKENDS)} (a name ending -again runs that one again)")
    ap.add_argument("--logs", type=Path, help="keep the servers' logs here (default: a temporary directory)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    why_not = cannot_place()
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    cells = [(c, int(c.split("x")[0]), int(c.split("x")[1])) for c in args.cells]
    args.max_total_tokens = max(n * k for _, n, k in cells) + 4096
    max_len = max(n for _, n, _ in cells) + args.max_tokens + 16
    rng = random.Random(7)
    results: dict[str, Any] = {"cells": args.cells, "rounds": args.rounds, "chunk": args.chunk}
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-sglang-") as tmp, hosts(2) as (a, b):
        base = Path(tmp)
        logs = args.logs or base
        logs.mkdir(parents=True, exist_ok=True)
        write_bench_model(base / "model", max_len)
        for h in (a, b):
            shutil.copytree(base / "model", f"/proc/{h.pid}/root{h.tmp}/model")
        for name in args.backends:
            # New prompts for every backend and batch: nothing is served from a cache.
            batches = [(c, [[rng.randrange(1, 500) for _ in range(n)] for _ in range(k)])
                       for _ in range(args.rounds) for c, n, k in cells]
            print(f"{name}: P on {a.address} (CPU 0), D on {b.address} (CPU 1) ...", file=sys.stderr)
            results[name] = run_backend(name, a, b, logs, batches, args)
    print(table({k: v for k, v in results.items() if isinstance(v, dict) and "cells" in v}, args.cells,
                args.backends))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
