"""Streamed vs pulled vs NixlConnector: vLLM P and D on two simulated hosts, time to first token
and the handover after P's prefill.

    sudo .venv-vllm/bin/python -m benchmarks.vllm_stream --json benchmarks/vllm-stream.json   (make bench-vllm-stream)

P runs on host a and D on host b (tests/hosts: own network namespace, /dev/shm and temp dir,
joined by a veth bridge), so the KV crosses a real kernel TCP path (UCX over TCP), as between
nodes without RDMA. The model is a random-weight Llama whose KV per token is large for its
compute (4 layers of 8 KV heads of 128: 16 KiB a token), so that moving the KV is a visible
share of the handover. P prefills in chunks of --chunk tokens. This process is the router,
timing each phase from outside: it sends P the request with one output token, and D the
client's request -- after P answered (pull: kvsvc or NixlConnector) or at once (stream: kvsvc,
as kvsvc's router does with --progressive; D reads each chunk while P computes the next).

Fair by construction: both connectors run the same engines' arguments, P pinned to CPU 0 and
D to CPU 1 (taskset on the whole process tree, checked for every thread after start-up);
the two kvsvc modes share one engine pair and alternate request by request; NixlConnector's
pair runs between two kvsvc rounds. Every batch uses prompts never sent before, and both
engines' prefix caches are emptied (and the reset checked: it succeeds only when no block
is held) before each. CPU seconds are counted per engine process tree.

Per prompt length and concurrency: TTFT (send to D's first token) and the tail (P's answer
to D's first token: what the handover adds after prefill), p50 and max over the samples
(too few for a p99: the max is given as such); the transfer's own time (D's connector
histogram, call to answer) and, for kvsvc, its wire time (READs posted to landed); the
chunks D read while P still prefilled. The tail hidden is 1 - tail(stream)/tail(pull); the tail
also holds D's own step that computes the first token, which no transfer takes off. The
transfer hidden is 1 - (a streamed transfer's time after D heard of P's final commit) / (a
pulled transfer's time, call to answer), both D's connector's own figures, per cell.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.vllm_pd import CONNECTORS, cpu_seconds, histogram, stream
from kvsvc.integrations.vllm import stream_params
from tests.hosts.harness import Host, available, hosts
from tests.vllm.engines import kernel_block_size
from tests.vllm.served import Served, amx_site, completion

PORT = 8000
NIXL_SIDE_PORT = 5600
# A batch's prompts at most (16 KiB a token: 2 GiB of KV on each side, of the 4 GiB cache).
MAX_BATCH_TOKENS = 131072
# P's answer to a request queued behind a batch's others: 32 prompts of 16,384 tokens take
# P about 200 s here with kvsvc, 430 s with NixlConnector (whose threads share P's core).
P_ANSWER_S = 1800


def write_bench_model(path: Path, max_positions: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def serve(host: Host, name: str, cpu: int, model: str, connector: dict[str, Any], logs: Path, max_len: int,
          extra: tuple[str, ...] = ()) -> Served:
    argv = [*host.launcher, "taskset", "-c", str(cpu), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", host.address, "--port", str(PORT), "--skip-tokenizer-init",
            "--return-tokens-as-token-ids", "--enforce-eager", "--max-model-len", str(max_len),
            "--block-size", str(kernel_block_size(head_size=128)), "--kv-transfer-config", json.dumps(connector),
            *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_PORT), **amx_site(connector)}
    return Served(name, argv, logs, PORT, env, host=host.address)


def _threads(s: Served) -> list[tuple[str, int]]:
    root = psutil.Process(s.proc.pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            out += [(proc.name(), t.id) for t in proc.threads()]
        except psutil.NoSuchProcess:
            pass
    return out


def pin(s: Served, cpu: int) -> int:
    """Every thread of the engine's processes to `cpu` alone (vLLM's CPU worker widens some of
    its threads' affinity itself, under taskset too); how many had to be moved."""
    moved = 0
    for _, tid in _threads(s):
        try:
            if os.sched_getaffinity(tid) != {cpu}:
                os.sched_setaffinity(tid, {cpu})
                moved += 1
        except (ProcessLookupError, PermissionError):
            pass
    return moved


def off_cpu(s: Served, cpu: int) -> list[str]:
    """The engine's threads that may run elsewhere than `cpu` (threads started after pin() and
    re-pinned by whoever started them: a connector's own)."""
    out = []
    for name, tid in _threads(s):
        try:
            allowed = os.sched_getaffinity(tid)
        except ProcessLookupError:
            continue
        if allowed != {cpu}:
            out.append(f"{name}/{tid}: {sorted(allowed)}")
    return out


def cannot_place() -> str:
    """Why P and D cannot be placed on two simulated hosts and two CPUs here ("": they can)."""
    why_not = available()
    if why_not is not None:
        return f"cannot simulate hosts here: {why_not}"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs two CPUs (P on one, D on the other)"
    return ""


def reset(*engines: Served) -> None:
    for e in engines:
        if not e.blocks_all_free(120):
            raise RuntimeError(f"{e.name} still holds KV blocks: its prefix cache could not be reset")


def one(p: Served, d: Served, prompt: list[int], max_tokens: int, mode: str,
        ident: dict[str, Any] | None) -> dict[str, float]:
    """One request as a router sends it; seconds from sending it: P's answer, D's first token."""
    t0 = time.perf_counter()
    body = completion(prompt, max_tokens)
    if mode.startswith("stream"):
        assert ident is not None
        order = stream_params.new_stream()
        d_body = {**body, "kv_transfer_params": stream_params.decode_stream_params(ident, order)}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(stream, d.url, d_body, t0)
            p.post("/v1/completions", completion(prompt, 1, kv_transfer_params=stream_params.prefill_stream_params(order)),
                   timeout_s=P_ANSWER_S)
            p_done = time.perf_counter() - t0
            ttft, _ = first.result()
    else:
        params = p.post("/v1/completions", completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}),
                        timeout_s=P_ANSWER_S)
        p_done = time.perf_counter() - t0
        ttft, _ = stream(d.url, {**body, "kv_transfer_params": params["kv_transfer_params"]}, t0)
    return {"ttft": ttft, "p_done": p_done, "tail": ttft - p_done}


def batch(p: Served, d: Served, prompts: list[list[int]], mode: str, ident: dict[str, Any] | None,
          max_tokens: int) -> list[dict[str, float]]:
    reset(p, d)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda pr: one(p, d, pr, max_tokens, mode, ident), prompts))


# Bucket bounds (seconds) of the per-transfer histograms read for a p50: kvsvc's overhead above
# the READs (pulled transfers) and vLLM's report delay; as the connector's histograms have them.
OVERHEAD_LE = ("0.00025", "0.0005", "0.001", "0.0015", "0.002", "0.003", "0.005", "0.0075", "0.01", "0.025", "0.05",
               "0.1", "+Inf")
REPORT_LE = ("0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "+Inf")
D_COUNTERS = ("xfer_sum", "xfer_count", "wire_sum", "wire_count", "report_sum", "report_count", "overhead_sum",
              "overhead_count", "after_final_sum", "after_final_count", "growing", "final", "p_cpu", "d_cpu",
              *(f"overhead_le_{b}" for b in OVERHEAD_LE),
              *(f"report_le_{b}" for b in REPORT_LE))

CELL_COUNTERS = ("xfer_sum", "xfer_count", "after_final_sum", "after_final_count")


def buckets(s: Served, name: str) -> dict[str, float]:
    """le -> cumulative count of a histogram in the engine's /metrics (summed over labels)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(requests.get(s.url + "/metrics", timeout=30).text):
        for sample in fam.samples:
            if sample.name == name + "_bucket":
                le = sample.labels["le"]
                out[le] = out.get(le, 0.0) + sample.value
    return out


def p50_at_most(c: dict[str, float], key: str, bounds: tuple[str, ...]) -> str | None:
    """The smallest bucket bound (ms) that holds at least half of a histogram's samples."""
    n = c[f"{key}_le_+Inf"]
    for b in bounds:
        if n and c[f"{key}_le_{b}"] >= n / 2:
            return b if b == "+Inf" else f"{1e3 * float(b):g}"
    return None


def d_counters(p: Served, d: Served, xfer_histogram: str) -> dict[str, float]:
    """The figures so far: D's transfer, wire and report-delay histograms, chunks read, and the
    CPU seconds of P's and D's processes."""
    xfer, wire = histogram(d, xfer_histogram), histogram(d, "vllm:kvsvc_wire_time_seconds")
    report, m = histogram(d, "vllm:kvsvc_report_delay_seconds"), d.metrics()
    overhead = histogram(d, "vllm:kvsvc_overhead_seconds")
    after_final = histogram(d, "vllm:kvsvc_stream_after_final_seconds")
    over_le, report_le = buckets(d, "vllm:kvsvc_overhead_seconds"), buckets(d, "vllm:kvsvc_report_delay_seconds")
    return {"xfer_sum": xfer[0], "xfer_count": xfer[1], "wire_sum": wire[0], "wire_count": wire[1],
            "report_sum": report[0], "report_count": report[1], "overhead_sum": overhead[0],
            "overhead_count": overhead[1], "after_final_sum": after_final[0], "after_final_count": after_final[1],
            **{f"overhead_le_{b}": over_le.get(b, 0.0) for b in OVERHEAD_LE},
            **{f"report_le_{b}": report_le.get(b, 0.0) for b in REPORT_LE},
            "growing": m.get("vllm:kvsvc_streamed_chunks_growing_total", 0.0),
            "final": m.get("vllm:kvsvc_streamed_chunks_final_total", 0.0), "p_cpu": cpu_seconds(p),
            "d_cpu": cpu_seconds(d)}


def per_mode(c: dict[str, float]) -> dict[str, Any]:
    """A mode's transfers: mean call-to-answer time (for a streamed one, from dispatch: it
    includes P's prefill), mean wire time, how long vLLM took to hear a load ended, chunks read
    while P prefilled and after, and P's and D's CPU seconds per request."""
    def mean_ms(key: str) -> float | None:
        return round(1e3 * c[f"{key}_sum"] / c[f"{key}_count"], 2) if c[f"{key}_count"] else None

    n = c["xfer_count"] or 1
    return {"transfers": int(c["xfer_count"]), "transfer_ms_mean": mean_ms("xfer"), "wire_ms_mean": mean_ms("wire"),
            "overhead_ms_mean": mean_ms("overhead"), "after_final_ms_mean": mean_ms("after_final"),
            "overhead_ms_p50_at_most": p50_at_most(c, "overhead", OVERHEAD_LE),
            "report_delay_ms_mean": mean_ms("report"), "report_delay_ms_p50_at_most": p50_at_most(c, "report", REPORT_LE), "chunks_read_growing": int(c["growing"]),
            "chunks_read_final": int(c["final"]), "p_cpu_s_per_request": round(c["p_cpu"] / n, 3),
            "d_cpu_s_per_request": round(c["d_cpu"] / n, 3)}


def summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    for key in ("ttft", "p_done", "tail"):
        values = sorted(s[key] for s in samples)
        out[f"{key}_ms_p50"] = round(1e3 * statistics.median(values), 1)
        out[f"{key}_ms_max"] = round(1e3 * values[-1], 1)
    return out


def run_pair(name: str, a: Host, b: Host, logs: Path, cells: list[tuple[int, int]], rounds: int,
             rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    """One engine pair through every (prompt length, in flight) cell, `rounds` times; kvsvc's
    pair runs both modes, alternating batch by batch."""
    conf = CONNECTORS["nixl" if name == "nixl" else "kvsvc"]
    p_conf, d_conf = dict(conf["p"]), dict(conf["d"])
    if name != "nixl":
        # The default deadlines: a streamed load's (stream_timeout_s) holds P's queue and prefill.
        p_conf["kv_connector_extra_config"] = {"listen_host": a.address}
        d_conf["kv_connector_extra_config"] = {"listen_host": b.address}
    if name == "kvsvc-chunks":  # the last chunk committed whole, after P's forward (no layer commits)
        p_conf["kv_connector_extra_config"]["layer_commits"] = 0
    chunk = ("--max-num-batched-tokens", str(args.chunk))
    p = serve(a, f"{name}-p", 0, f"{a.tmp}/model", p_conf, logs, args.max_len, chunk)
    d = serve(b, f"{name}-d", 1, f"{b.tmp}/model", d_conf, logs, args.max_len)
    modes = {"nixl": ["nixl"], "kvsvc-chunks": ["pull", "stream-chunks"]}.get(name, ["pull", "stream"])
    try:
        p.wait_ready(900)
        d.wait_ready(900)
        warm = [rng.randrange(1, 500) for _ in range(256)]
        params = p.post("/v1/completions", completion(warm, 1, kv_transfer_params={"do_remote_decode": True}))
        stream(d.url, completion(warm, 2, kv_transfer_params=params["kv_transfer_params"]), time.perf_counter())
        ident = stream_params.identity(params["kv_transfer_params"])
        moved = {"p": pin(p, 0), "d": pin(d, 1)}  # after the first transfer: its threads exist now
        samples: dict[str, list[dict[str, float]]] = {}
        counted: dict[str, dict[str, float]] = {m: dict.fromkeys(D_COUNTERS, 0.0) for m in modes}
        per_cell: dict[str, dict[str, float]] = {}  # the transfers' sums and counts, per mode and cell
        cpu0 = (cpu_seconds(p), cpu_seconds(d))
        for r in range(rounds):
            for length, inflight in cells:
                for mode in (modes if (r + name.endswith("again")) % 2 == 0 else modes[::-1]):  # each order as often
                    prompts = [[rng.randrange(1, 500) for _ in range(length)] for _ in range(inflight)]
                    before = d_counters(p, d, conf["histogram"])
                    got = batch(p, d, prompts, mode, ident, args.max_tokens)
                    after = d_counters(p, d, conf["histogram"])
                    for k in D_COUNTERS:
                        counted[mode][k] += after[k] - before[k]
                    key = f"{mode} {length} x{inflight}"
                    into = per_cell.setdefault(key, dict.fromkeys(CELL_COUNTERS, 0.0))
                    for k in CELL_COUNTERS:
                        into[k] += after[k] - before[k]
                    samples.setdefault(key, []).extend(got)
                    print(f"  {mode}: {length} tokens x{inflight}: {summary(got)}", file=sys.stderr)
        cpu1 = (cpu_seconds(p), cpu_seconds(d))
        return {"cells": {k: summary(v) for k, v in samples.items()},
                "samples": {k: [{x: round(v, 4) for x, v in one.items()} for one in got] for k, got in samples.items()},
                "per_mode": {m: per_mode(c) for m, c in counted.items()}, "per_cell": per_cell,
                "threads_repinned": moved, "threads_off_cpu_after": {"p": off_cpu(p, 0), "d": off_cpu(d, 1)},
                "p_cpu_s": round(cpu1[0] - cpu0[0], 1), "d_cpu_s": round(cpu1[1] - cpu0[1], 1)}
    finally:
        p.stop()
        d.stop()


def table(results: dict[str, Any], cells: list[tuple[int, int]]) -> str:
    """The markdown table: per cell, TTFT and tail p50 (max) per mode, the tail hidden, and the
    transfer hidden (D's connector's figures: streamed time after P's final commit against the
    pulled transfer's time, means over both kvsvc runs)."""
    def cell(mode: str, length: int, inflight: int) -> dict[str, Any] | None:
        key = f"{mode} {length} x{inflight}"  # every run's samples of it (kvsvc's two runs)
        got = [x for r in results.values() if isinstance(r, dict) for x in r.get("samples", {}).get(key, ())]
        return summary(got) if got else None

    def mean(mode: str, length: int, inflight: int, what: str) -> float | None:
        key = f"{mode} {length} x{inflight}"
        sums = [r["per_cell"][key] for r in results.values() if isinstance(r, dict) and key in r.get("per_cell", {})]
        count = sum(c[f"{what}_count"] for c in sums)
        return sum(c[f"{what}_sum"] for c in sums) / count if count else None

    chunks = any(k.startswith("stream-chunks") for r in results.values() if isinstance(r, dict)
                 for k in r.get("per_cell", {}))
    rows = ["| prompt | in flight | TTFT p50 (max): pull | stream | NixlConnector | tail p50: pull | stream | "
            "NixlConnector | tail hidden | transfer: pulled | streamed after prefill | transfer hidden |"
            + (" streamed after prefill, last chunk whole | hidden |" if chunks else ""),
            "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if chunks else "")]
    for length, inflight in cells:
        got = {m: cell(m, length, inflight) for m in ("pull", "stream", "nixl")}
        if got["pull"] is None or got["stream"] is None:
            continue
        ttft = [_shown(got[m], "{ttft_ms_p50:.0f} ({ttft_ms_max:.0f}) ms") for m in ("pull", "stream", "nixl")]
        tail = [_shown(got[m], "{tail_ms_p50:.0f} ms") for m in ("pull", "stream", "nixl")]
        hidden = 1 - got["stream"]["tail_ms_p50"] / got["pull"]["tail_ms_p50"] if got["pull"]["tail_ms_p50"] else 0
        pulled, after = mean("pull", length, inflight, "xfer"), mean("stream", length, inflight, "after_final")
        moved = ["--", "--", "--"]
        if pulled and after is not None:
            moved = [f"{1e3 * pulled:.0f} ms", f"{1e3 * after:.0f} ms", f"{100 * (1 - after / pulled):.0f} %"]
        if chunks:
            whole = mean("stream-chunks", length, inflight, "after_final")
            moved += [f"{1e3 * whole:.0f} ms", f"{100 * (1 - whole / pulled):.0f} %"] if pulled and whole else ["--"] * 2
        rows.append(f"| {length:,} | {inflight} | {' | '.join(ttft)} | {' | '.join(tail)} | {100 * hidden:.0f} % | "
                    f"{' | '.join(moved)} |")
    return "\n".join(rows)


def _shown(cell: dict[str, Any] | None, text: str) -> str:
    return "--" if cell is None else text.format(**cell)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 32],
                    help=f"requests in flight (a batch of more than {MAX_BATCH_TOKENS:,} tokens is left out)")
    ap.add_argument("--cells", nargs="+", default=[], metavar="LENGTHxINFLIGHT",
                    help="only these cells (e.g. 4096x8), instead of every length with every in-flight count")
    ap.add_argument("--rounds", type=int, default=2, help="passes over every cell, per engine pair")
    ap.add_argument("--chunk", type=int, default=512, help="P's prefill chunk (--max-num-batched-tokens)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pairs", nargs="+", default=["kvsvc", "nixl", "kvsvc-again"],
                    help="engine pairs to run, in order (NixlConnector's between two kvsvc runs by default; "
                    "kvsvc-chunks: P commits the last chunk whole, after its forward, beside pulled requests)")
    ap.add_argument("--logs", type=Path, help="keep the engines' logs here (default: a temporary directory)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    why_not = cannot_place()
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    cells = [(int(c.split("x")[0]), int(c.split("x")[1])) for c in args.cells] or [
        (n, k) for n in args.lengths for k in args.inflight if n * k <= MAX_BATCH_TOKENS]
    args.max_len = max(n for n, _ in cells) + args.max_tokens + 16
    rng = random.Random(7)
    results: dict[str, Any] = {"cells": [f"{n}x{k}" for n, k in cells], "rounds": args.rounds, "chunk": args.chunk}
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-stream-") as tmp, hosts(2) as (a, b):
        base = Path(tmp)
        logs = args.logs or base
        logs.mkdir(parents=True, exist_ok=True)
        write_bench_model(base / "model", args.max_len)
        for h in (a, b):
            shutil.copytree(base / "model", f"/proc/{h.pid}/root{h.tmp}/model")
        for name in args.pairs:
            print(f"{name}: starting P on {a.address} (CPU 0) and D on {b.address} (CPU 1) ...", file=sys.stderr)
            results[name] = run_pair(name, a, b, logs, cells, max(1, args.rounds // 2) if name != "nixl"
                                     else args.rounds, rng, args)
    print(table(results, cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
