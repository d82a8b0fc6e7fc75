"""Under load, side by side: one vLLM P/D pair with KvsvcConnector, with vLLM's NixlConnector,
and the aggregated engine (no disaggregation), on the same stream of requests.

    make bench-vllm     (or: .venv-vllm/bin/python -m benchmarks.vllm_load --json benchmarks/vllm-load.json --plot ...)

Each configuration starts its engines once (`vllm serve`, TP 1, the same random-weight
Llama written at start), warms up, then runs the same requests at each concurrency (1, 8
and 32 in flight by default): prompts of 128 to 2,048 tokens, a quarter of them sharing a
prefix with an earlier one, 16 tokens decoded each, greedy. A P/D request is what a router
does: P with one output token and {"do_remote_decode": true}, then D streamed with P's
kv_transfer_params. Measured per configuration and concurrency:
- TTFT: from sending the request (to P) to D's first streamed token, p50 and p99;
- P-done to first token: from P's answer to D's first token (the KV load is in it);
- transfer time: each connector's own histogram in D's /metrics, mean per load;
- P's scheduler time per finished request (request_finished, p50 and p99), timed inside the
  engine by benchmarks/finish_timer (no connector code changed): the time vLLM's engine thread
  spends there while every other request of the engine waits;
- generated tokens per second over the run, failed requests, and how many answers equal the
  aggregated engine's at the same concurrency.
Absolute figures on a shared 2-core machine are noisy; the comparison is the point.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from benchmarks.vllm_pd import CONNECTORS, histogram, stream
from tests.vllm.engines import side_channel_ports, write_model
from tests.vllm.served import Served, completion, vllm_serve

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2112  # the longest prompt (2,048) and what is decoded
CONFIGS = ("aggregated", "kvsvc", "nixl")


def make_prompts(n: int, rng: random.Random, lo: int = 128, hi: int = 2048) -> list[list[int]]:
    """n prompts of lo..hi tokens; every fourth starts with a prefix of an earlier one (a
    shared system prompt, a multi-turn chat), so prefix caching plays its part."""
    out: list[list[int]] = []
    for i in range(n):
        length = rng.randrange(lo, hi + 1)
        if i % 4 == 3 and out:
            base = rng.choice(out)
            shared = base[:min(len(base), length) // 2]
            out.append(shared + [rng.randrange(1, 500) for _ in range(length - len(shared))])
        else:
            out.append([rng.randrange(1, 500) for _ in range(length)])
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_request(engines: dict[str, Served], prompt: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        if "agg" in engines:
            ttft, ids = stream(engines["agg"].url, completion(prompt, max_tokens), t0)
            return {"ttft": ttft, "p_done": None, "ids": ids}
        r = requests.post(engines["p"].url + "/v1/completions", timeout=600,
                          json=completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
        if r.status_code != 200:
            raise RuntimeError(f"P answered HTTP {r.status_code}: {r.text[:300]}")
        p_done = time.perf_counter() - t0
        ttft, ids = stream(engines["d"].url, completion(prompt, max_tokens,
                                                        kv_transfer_params=r.json()["kv_transfer_params"]), t0)
        return {"ttft": ttft, "p_done": p_done, "ids": ids}
    except Exception as e:  # counted, and the run goes on
        return {"error": str(e)[:300]}


def start(config: str, model: Path, logs: Path, finish_times: Path) -> dict[str, Served]:
    extra = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64")
    if config == "aggregated":
        return {"agg": vllm_serve("agg", model, logs, None, extra_args=extra)}
    conf = CONNECTORS[config]
    timer = {"PYTHONPATH": f"{ROOT / 'benchmarks' / 'finish_timer'}:{ROOT}", "KVSVC_BENCH_FINISH_TIMES": str(finish_times)}
    return {"p": vllm_serve(f"{config}-p", model, logs, conf["p"], extra_args=extra,
                            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_ports(1)), **timer}),
            "d": vllm_serve(f"{config}-d", model, logs, conf["d"], extra_args=extra,
                            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_ports(1))})}


def run_config(config: str, model: Path, logs: Path, prompts: list[list[int]], warm_up: list[list[int]],
               concurrencies: list[int], max_tokens: int) -> dict[str, Any]:
    finish_times = logs / f"{config}-finish-times.txt"
    engines = start(config, model, logs, finish_times)
    try:
        for e in engines.values():
            e.wait_ready()
        for prompt in warm_up:
            one_request(engines, prompt, 2)
        out: dict[str, Any] = {}
        for c in concurrencies:
            for e in engines.values():
                e.post("/reset_prefix_cache")  # every run starts cold (the shared prefixes are within it)
            finish_times.unlink(missing_ok=True)
            h0 = histogram(engines["d"], CONNECTORS[config]["histogram"]) if config in CONNECTORS else (0, 0)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                results = list(pool.map(lambda p: one_request(engines, p, max_tokens), prompts))
            wall = time.perf_counter() - t0
            h1 = histogram(engines["d"], CONNECTORS[config]["histogram"]) if config in CONNECTORS else (0, 0)
            ok = [r for r in results if "error" not in r]
            ttft = [r["ttft"] for r in ok]
            after_p = [r["ttft"] - r["p_done"] for r in ok if r["p_done"] is not None]
            finish = [float(x) for x in finish_times.read_text().split()] if finish_times.exists() else []
            loads = h1[1] - h0[1]
            out[str(c)] = {
                "ttft_ms_p50": _ms(pct(ttft, 0.5)), "ttft_ms_p99": _ms(pct(ttft, 0.99)),
                "p_done_to_first_token_ms_p50": _ms(pct(after_p, 0.5)),
                "p_done_to_first_token_ms_p99": _ms(pct(after_p, 0.99)),
                "transfer_ms_mean": _ms((h1[0] - h0[0]) / loads) if loads else None,
                "p_request_finished_us_p50": _us(pct(finish, 0.5)), "p_request_finished_us_p99": _us(pct(finish, 0.99)),
                "p_request_finished_calls": len(finish),
                "tokens_per_s": round(sum(len(r["ids"]) for r in ok) / wall, 1),
                "failed": len(results) - len(ok), "errors": sorted({r["error"] for r in results if "error" in r})[:3],
                "wall_s": round(wall, 2), "outputs": [r.get("ids") for r in results],
            }
            print(f"  {config} at {c} in flight: TTFT p50 {out[str(c)]['ttft_ms_p50']} ms, p99 "
                  f"{out[str(c)]['ttft_ms_p99']} ms, {out[str(c)]['failed']} failed", file=sys.stderr)
        return out
    finally:
        for e in engines.values():
            e.stop()


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1e3 * s, 2)


def _us(s: float | None) -> float | None:
    return None if s is None else round(1e6 * s, 1)


ROWS = [("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p99 (ms)", "ttft_ms_p99"),
        ("P done -> first token p50 (ms)", "p_done_to_first_token_ms_p50"),
        ("P done -> first token p99 (ms)", "p_done_to_first_token_ms_p99"),
        ("transfer time mean (ms)", "transfer_ms_mean"),
        ("P request_finished p50 (us)", "p_request_finished_us_p50"),
        ("P request_finished p99 (us)", "p_request_finished_us_p99"),
        ("tokens / s", "tokens_per_s"), ("failed requests", "failed"), ("same tokens as aggregated", "same")]


def compare(results: dict[str, Any], concurrencies: list[int]) -> None:
    """Each P/D run's answers next to the aggregated run's at the same concurrency."""
    for c in map(str, concurrencies):
        reference = results["aggregated"][c]["outputs"] if "aggregated" in results else None
        for config in results:
            outs = results[config][c].pop("outputs")
            if reference is not None:
                results[config][c]["same"] = sum(a is not None and a == b for a, b in zip(outs, reference, strict=True))


def table(results: dict[str, Any], concurrencies: list[int], n: int) -> str:
    lines = []
    for c in map(str, concurrencies):
        lines.append(f"\n{n} requests, {c} in flight")
        lines.append(f"{'':34}{'kvsvc':>12}{'NixlConnector':>16}{'aggregated':>12}")
        for label, key in ROWS:
            cells = [results[config][c].get(key) if config in results else None
                     for config in ("kvsvc", "nixl", "aggregated")]
            lines.append(f"{label:34}" + "".join(f"{'-' if v is None else v!s:>{w}}"
                                                  for v, w in zip(cells, (12, 16, 12), strict=True)))
    return "\n".join(lines)


def plot(results: dict[str, Any], concurrencies: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        for config, label in (("kvsvc", "kvsvc"), ("nixl", "NixlConnector"), ("aggregated", "aggregated")):
            ax.plot(concurrencies, [results[config][str(c)][f"ttft_ms_{q}"] for c in concurrencies], marker="o",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(f"TTFT {q} (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("vLLM P/D on one 2-core host: time to first token under load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, help="save the figures here")
    ap.add_argument("--plot", type=Path, help="save a PNG of TTFT p50/p99 against concurrency here")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                    help="run only these (the table then compares what ran)")
    ap.add_argument("--keep-logs", type=Path, help="copy the engines' logs here")
    args = ap.parse_args(argv)
    rng = random.Random(7)
    prompts = make_prompts(args.requests, rng)
    warm_up = make_prompts(2, random.Random(8), 64, 128)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-vllm-load-") as tmp:
        base = Path(tmp)
        write_model(base / "model", max_positions=4096)
        for config in args.configs:
            print(f"{config}: starting ...", file=sys.stderr)
            results[config] = run_config(config, base / "model", base, prompts, warm_up, args.concurrency,
                                         args.max_tokens)
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in base.glob("*.log"):
                shutil.copy(log, args.keep_logs / log.name)
    compare(results, args.concurrency)
    print(table(results, args.concurrency, args.requests))
    failed = sum(results[c][str(k)]["failed"] for c in results for k in args.concurrency)
    if args.json:
        args.json.write_text(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens,
                                         "concurrency": args.concurrency, **results}, indent=2) + "\n")
        print(f"saved {args.json}")
    if args.plot and len(results) == len(CONFIGS):
        plot(results, args.concurrency, args.plot)
        print(f"saved {args.plot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
