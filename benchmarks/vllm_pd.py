"""Side by side: the same vLLM P/D pair with KvsvcConnector and with vLLM's NixlConnector.

    make bench-vllm        (or: .venv-vllm/bin/python -m benchmarks.vllm_pd --json benchmarks/vllm.json)

Both pairs are `vllm serve` engines (TP 1 each) on the same random-weight Llama written
at start, fed the same prompts one request at a time: P prefills (one token, leasing its
KV), then D gets P's kv_transfer_params and streams. Measured per connector:
- D's time to first token: from sending D the request to its first streamed token
  (this includes the whole KV load: D schedules the request only once it is loaded);
- transfer time: each connector's own histogram in D's /metrics
  (vllm:kvsvc_xfer_time_seconds, vllm:nixl_xfer_time_seconds), mean per request;
- CPU seconds per request of P's and of D's processes (engine core, workers, API server),
  over the measured requests; vLLM's engines poll, so this includes their idle spinning;
- that both answer the same tokens (the bytes moved are the same).
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
from pathlib import Path
from typing import Any

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.vllm.engines import KVSVC, side_channel_ports, write_model
from tests.vllm.served import Served, completion, vllm_serve

CONNECTORS: dict[str, dict[str, Any]] = {
    "kvsvc": {"p": dict(KVSVC, kv_role="kv_producer"), "d": dict(KVSVC, kv_role="kv_consumer"),
              "histogram": "vllm:kvsvc_xfer_time_seconds"},
    "nixl": {"p": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
             "d": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
             "histogram": "vllm:nixl_xfer_time_seconds"},
}


def cpu_seconds(s: Served) -> float:
    """CPU time (user + system) of a served engine's processes so far."""
    total = 0.0
    try:
        root = psutil.Process(s.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def histogram(s: Served, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in the engine's /metrics."""
    text = requests.get(s.url + "/metrics", timeout=30).text
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    return total, count


def stream(url: str, body: dict[str, Any], t0: float) -> tuple[float, list[int]]:
    """(seconds from t0 to the first streamed token, token ids) of a streamed completion."""
    first = None
    ids: list[int] = []
    with requests.post(url + "/v1/completions", stream=True, timeout=600, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "choices" not in event:  # an error mid-stream (vLLM sends it as an event)
                    raise RuntimeError(f"the stream ended with {line[6:300].decode(errors='replace')}")
                got = event["choices"][0].get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                ids += got
    if first is None:
        raise RuntimeError("no token streamed")
    return first, ids


def decode_streamed(d: Served, prompt: list[int], params: dict[str, Any], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, token ids) of one streamed request to D."""
    return stream(d.url, completion(prompt, max_tokens, kv_transfer_params=params), time.perf_counter())


def run_pair(name: str, model: Path, logs: Path, warm_up: list[list[int]], prompts: list[list[int]],
             max_tokens: int, extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """extra_args: given to both engines (e.g. a GPU memory share when they share a GPU)."""
    conf = CONNECTORS[name]
    env_p = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_ports(1))}
    env_d = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_ports(1))}
    p = vllm_serve(f"{name}-p", model, logs, conf["p"], env=env_p, extra_args=extra_args)
    d = vllm_serve(f"{name}-d", model, logs, conf["d"], env=env_d, extra_args=extra_args)
    try:
        p.wait_ready()
        d.wait_ready()
        for prompt in warm_up:  # warm-up: first contact, handshakes, allocator
            for attempt in (1, 2):
                params = p.post("/v1/completions", completion(prompt, 1,
                                                              kv_transfer_params={"do_remote_decode": True}))
                try:
                    decode_streamed(d, prompt, params["kv_transfer_params"], 2)
                    break
                except RuntimeError as e:
                    # First contact: NixlConnector's handshake fails its request when P's side
                    # channel takes over 5 s to answer (a constant in vLLM 0.32), as a busy or
                    # paging CPU host does; the next request handshakes again.
                    if attempt == 2:
                        raise
                    print(f"  {name}: a warm-up request failed ({e}); once more", file=sys.stderr)
        d.post("/reset_prefix_cache")
        cpu0 = (cpu_seconds(p), cpu_seconds(d))
        h0 = histogram(d, conf["histogram"])
        t0 = time.perf_counter()
        ttft, outputs = [], []
        for i, prompt in enumerate(prompts):
            params = p.post("/v1/completions", completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
            first, ids = decode_streamed(d, prompt, params["kv_transfer_params"], max_tokens)
            ttft.append(first)
            outputs.append(ids)
            print(f"  {name}: request {i + 1}/{len(prompts)}: D's first token in {first * 1e3:.1f} ms", file=sys.stderr)
        wall = time.perf_counter() - t0
        h1 = histogram(d, conf["histogram"])
        cpu1 = (cpu_seconds(p), cpu_seconds(d))
        n = len(prompts)
        loads = h1[1] - h0[1]
        return {
            "requests": n,
            "d_ttft_ms_p50": round(1e3 * statistics.median(ttft), 2),
            "d_ttft_ms_mean": round(1e3 * statistics.fmean(ttft), 2),
            "d_ttft_ms_max": round(1e3 * max(ttft), 2),
            "transfer_ms_mean": round(1e3 * (h1[0] - h0[0]) / loads, 3) if loads else None,
            "transfers_recorded": int(loads),
            "p_cpu_s_per_request": round((cpu1[0] - cpu0[0]) / n, 4),
            "d_cpu_s_per_request": round((cpu1[1] - cpu0[1]) / n, 4),
            "p_cpu_cores": round((cpu1[0] - cpu0[0]) / wall, 2),  # CPU seconds per second over the run
            "d_cpu_cores": round((cpu1[1] - cpu0[1]) / wall, 2),
            "wall_s": round(wall, 2),
            "outputs": outputs,
        }
    finally:
        p.stop()
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=320, help="tokens per prompt (max 500)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, help="save the figures here")
    args = ap.parse_args(argv)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 2)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-vllm-") as tmp:
        base = Path(tmp)
        write_model(base / "model")
        for name in CONNECTORS:
            print(f"{name}: starting a P and a D engine ...", file=sys.stderr)
            results[name] = run_pair(name, base / "model", base, prompts[:2], prompts[2:], args.max_tokens)
    same = results["kvsvc"].pop("outputs") == results["nixl"].pop("outputs")
    rows = [("D time to first token p50 (ms)", "d_ttft_ms_p50"), ("D time to first token mean (ms)", "d_ttft_ms_mean"),
            ("D time to first token max (ms)", "d_ttft_ms_max"), ("transfer time mean (ms)", "transfer_ms_mean"),
            ("P CPU s / request", "p_cpu_s_per_request"), ("D CPU s / request", "d_cpu_s_per_request"),
            ("P CPU cores busy", "p_cpu_cores"), ("D CPU cores busy", "d_cpu_cores"),
            ("wall time (s)", "wall_s")]
    print(f"\n{args.requests} requests of {args.prompt_tokens} tokens, {args.max_tokens} decoded, one at a time")
    print(f"{'':34}{'kvsvc':>12}{'NixlConnector':>16}")
    for label, key in rows:
        print(f"{label:34}{results['kvsvc'][key]!s:>12}{results['nixl'][key]!s:>16}")
    print(f"same tokens from both: {same}")
    if args.json:
        args.json.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                         "same_tokens": same, **results}, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
