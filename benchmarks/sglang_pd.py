"""Side by side: the same SGLang P/D pair with the kvsvc transfer backend and with SGLang's NIXL backend.

    make bench-sglang      (or: .venv-sglang/bin/python -m benchmarks.sglang_pd --json benchmarks/sglang.json)

Each pair is SGLang's own servers (prefill, decode) behind its router, on the same
random-weight Llama written at start, for each TP shape asked (default P1->D1 and
P2->D1). Measured per backend:
- time to first token through the router, requests one at a time (P's prefill, the KV
  transfer and D's first step: the transfer is the part that differs);
- P's transfer latency, SGLang's own histogram (sglang:kv_transfer_latency_ms: from the
  first chunk handed to the backend to its Success on P), mean per request;
- kvsvc only: its transfer time on D (kvsvc_transfer_seconds of the embedded servers);
- a burst of concurrent requests: wall time and requests that failed;
- that both backends answer the same tokens.
Absolute figures on a shared 2-core machine are noisy; the comparison is the point.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sglang_placed import first_token
from tests.sglang.served import generate, kvsvc_servers, metric, sglang_router, sglang_server
from tests.sglang.test_sglang_cpu import write_model
from tests.vllm.served import Served

BACKENDS = ("kvsvc", "nixl")


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram at a /metrics URL."""
    total = count = 0.0
    for fam in text_string_to_metric_families(requests.get(url, timeout=30).text):
        for sample in fam.samples:
            if sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    return total, count


def streamed(router: Served, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, token ids) of one request through the router."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    return first_token(router.url, body, time.perf_counter())


def one(router: Served, ids: list[int], max_tokens: int) -> bool:
    r = requests.post(router.url + "/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    return r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


def run_pair(backend: str, tp_p: int, model: Path, logs: Path, prompts: list[list[int]], burst: list[list[int]],
             max_tokens: int) -> dict[str, Any]:
    config = logs / "kvsvc.toml"
    config.write_text('[server]\nmetrics_listen = "127.0.0.1:0"\n')
    env = {"KVSVC_SGLANG_CONFIG": str(config)}
    (p, bootstrap), (d, _) = (
        sglang_server(f"{backend}-p", model, logs, mode="prefill", backend=backend, tp=tp_p,
                      extra_args=("--enable-metrics",), env=env),
        sglang_server(f"{backend}-d", model, logs, mode="decode", backend=backend, env=env))
    procs = [p, d]
    try:
        p.wait_ready(300)
        d.wait_ready(300)
        router = sglang_router(logs, p, bootstrap, d, name=f"{backend}-router", extra_args=("--disable-retries",))
        procs.append(router)
        router.wait_ready(60)
        for ids in prompts[:2]:  # warm-up: the router registering its workers, first contact, handshakes
            generate(router, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        for s in (p, d):
            requests.post(s.url + "/flush_cache", timeout=60)
        p_latency0 = histogram(p.url + "/metrics", "sglang:kv_transfer_latency_ms")
        d_kvsvc = [url for _, url in kvsvc_servers(d).values()]
        kv0 = [histogram(u, "kvsvc_transfer_seconds") for u in d_kvsvc]
        ttft, outputs = [], []
        for i, ids in enumerate(prompts[2:]):
            first, out = streamed(router, ids, max_tokens)
            ttft.append(first)
            outputs.append(out)
            print(f"  {backend} P{tp_p}->D1: request {i + 1}/{len(prompts) - 2}: first token in {first * 1e3:.1f} ms",
                  file=sys.stderr)
        p_latency1 = histogram(p.url + "/metrics", "sglang:kv_transfer_latency_ms")
        kv1 = [histogram(u, "kvsvc_transfer_seconds") for u in d_kvsvc]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(burst)) as pool:
            ok = list(pool.map(lambda ids: one(router, ids, max_tokens), burst))
        burst_s = time.perf_counter() - t0
        n_lat = p_latency1[1] - p_latency0[1]
        n_kv = sum(b[1] - a[1] for a, b in zip(kv0, kv1, strict=True))
        return {
            "requests": len(ttft),
            "ttft_ms_p50": round(1e3 * statistics.median(ttft), 2),
            "ttft_ms_mean": round(1e3 * statistics.fmean(ttft), 2),
            "ttft_ms_max": round(1e3 * max(ttft), 2),
            "p_transfer_latency_ms_mean": round((p_latency1[0] - p_latency0[0]) / n_lat, 2) if n_lat else None,
            "kvsvc_transfer_ms_mean": round(1e3 * sum(b[0] - a[0] for a, b in zip(kv0, kv1, strict=True)) / n_kv, 3)
            if n_kv else None,
            "burst_requests": len(burst),
            "burst_failed": ok.count(False),
            "burst_wall_s": round(burst_s, 2),
            "kvsvc_failed_transfers": sum(metric(u, "kvsvc_transfers_total", outcome="failed") for u in d_kvsvc),
            "outputs": outputs,
        }
    finally:
        for s in procs:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests after the timed ones")
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tp-p", type=int, nargs="+", default=[1, 2], help="P's TP sizes (D runs TP 1)")
    ap.add_argument("--json", type=Path, help="save the figures here")
    args = ap.parse_args(argv)
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(1, 500) for _ in range(args.prompt_tokens)]

    prompts = [prompt() for _ in range(args.requests + 2)]
    burst = [prompt() for _ in range(args.burst)]
    results: dict[str, Any] = {}
    same = True
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-sglang-") as tmp:
        base = Path(tmp)
        write_model(base / "model")
        for tp_p in args.tp_p:
            shape = f"p{tp_p}-d1"
            results[shape] = {}
            for backend in BACKENDS:
                print(f"{backend} {shape}: starting SGLang's P, D and router ...", file=sys.stderr)
                logs = base / f"{backend}-{shape}"
                logs.mkdir()
                results[shape][backend] = run_pair(backend, tp_p, base / "model", logs, prompts, burst,
                                                   args.max_tokens)
            outs = [results[shape][b].pop("outputs") for b in BACKENDS]
            results[shape]["same_tokens"] = outs[0] == outs[1]
            same &= outs[0] == outs[1]
    rows = [("time to first token p50 (ms)", "ttft_ms_p50"), ("time to first token mean (ms)", "ttft_ms_mean"),
            ("time to first token max (ms)", "ttft_ms_max"),
            ("P transfer latency mean (ms)", "p_transfer_latency_ms_mean"),
            ("kvsvc transfer on D mean (ms)", "kvsvc_transfer_ms_mean"),
            (f"burst of {args.burst}: wall (s)", "burst_wall_s"), (f"burst of {args.burst}: failed", "burst_failed")]
    for shape, by in results.items():
        print(f"\n{shape}: {args.requests} requests of {args.prompt_tokens} tokens one at a time, "
              f"{args.max_tokens} decoded")
        print(f"{'':34}{'kvsvc':>12}{'SGLang NIXL':>14}")
        for label, key in rows:
            print(f"{label:34}{by['kvsvc'][key]!s:>12}{by['nixl'][key]!s:>14}")
        print(f"same tokens from both: {by['same_tokens']}")
    if args.json:
        args.json.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                         **results}, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
