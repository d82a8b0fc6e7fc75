"""The benchmark's figures as tables on stdout, and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsvc.transport.copy_lanes import LANE_READ_MIN_BYTES

MIB = 1 << 20


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_report(res: dict[str, Any]) -> None:
    print(f"kvsvc bench: P TP1 -> D TP1, {res['layers']} layers of GQA (8 KV heads of 128, bf16, blocks of 16), "
          f"{res['runs']} runs per point, verified={res['verified']}, UCX: {', '.join(res['ucx_transports']) or '-'}")
    print()
    print(f"{'size':>10} {'blocks':>10} {'desc':>6} | {'Transfer ms':>17} {'wire ms':>17} | "
          f"{'kvsvc':>6} {'wire':>6} {'raw':>6} {'memcpy':>6} GB/s | {'P CPU':>6} {'D CPU':>6} s/GB")
    print(f"{'':>10} {'':>10} {'':>6} | {'p50':>8} {'p99':>8} {'p50':>8} {'p99':>8} |")
    for p in res["sizes"]:
        size = f"{p['bytes'] / MIB:.2f} MiB"
        print(f"{size:>10} {str(p['blocks']) + ' ' + p['pattern'][:4]:>10} {p['descriptors']:>6} | "
              f"{p['transfer_p50_ms']:>8.2f} {p['transfer_p99_ms']:>8.2f} {p['wire_p50_ms']:>8.2f} "
              f"{p['wire_p99_ms']:>8.2f} | {p['kvsvc_transfer_gbps']:>6.2f} {p['kvsvc_wire_gbps']:>6.2f} "
              f"{_f(p.get('raw_nixl_gbps')):>6} {p['memcpy_gbps']:>6.2f}      | "
              f"{_f(p.get('prefill_cpu_s_per_gb'), '.3f'):>6} {_f(p.get('decode_cpu_s_per_gb'), '.3f'):>6}")
    print()
    print(f"{'in flight':>10} {'api':>11} {'transfers/s':>12} | {'Transfer p50':>12} {'p99':>8} | {'wire p50':>9} "
          f"{'p99':>8} | {'P CPU':>6} {'D CPU':>6} s/GB   (1-block requests)")
    for c in res["concurrency"]:
        print(f"{c['in_flight']:>10} {c.get('api', ''):>11} {c['transfers_per_s']:>12.0f} | {c['transfer_p50_ms']:>12.2f} "
              f"{c['transfer_p99_ms']:>8.2f} | {c['wire_p50_ms']:>9.2f} {c['wire_p99_ms']:>8.2f} | "
              f"{_f(c.get('prefill_cpu_s_per_gb'), '.3f'):>6} {_f(c.get('decode_cpu_s_per_gb'), '.3f'):>6}")
    cold = res["cold"]
    print()
    print(f"overhead (1 block, Transfer p50 - wire p50): {res['overhead_p50_ms']:.3f} ms on the TransferStream "
          f"({res.get('transfer_carrier') or '?'} carrier: 'stream' above), "
          f"{_f(res.get('overhead_p50_ms_grpc_stream'), '.3f')} ms on it over gRPC, "
          f"{_f(res.get('overhead_p50_ms_unary'), '.3f')} ms with unary calls; a bare gRPC round trip here: "
          f"{res['grpc_round_trip_p50_ms']:.3f} ms to D, {_f(res.get('grpc_round_trip_p50_ms_prefill'), '.3f')} ms to P")
    print(f"cold vs warm ({cold['blocks']} blocks into D blocks never written, then again): wire p50 "
          f"{cold['cold_wire_p50_ms']:.3f} vs {cold['warm_wire_p50_ms']:.3f} ms = {cold['cold_over_warm']:.2f}x")
    for k in ("shuffled", "contiguous"):
        v = res.get(f"kvsvc_over_raw_nixl_{k}")
        print(f"kvsvc / raw NIXL at {res['bytes_per_transfer'] / MIB:.0f} MiB, {k}: {_f(v, '.3f')}")
    if res.get("decode_copy_threads"):
        print(f"  (D splits a READ of {LANE_READ_MIN_BYTES // MIB} MiB or more over {res['decode_copy_threads']} copy "
              "threads; raw NIXL posts it as one READ from one agent: the same bytes, one thread's copy)")
    if res["raw_nixl_error"]:
        print(f"raw NIXL skipped: {res['raw_nixl_error']}")
    print(f"planning a 128k-token request over 61 MLA layers: {res['plan_128k_tokens_61_layers_ms']:.1f} ms "
          f"({res['plan_128k_descriptors']} descriptors)")
    print("planning a 1-block request: " + ", ".join(f"{us:.0f} us at {layers} layers"
                                                       for layers, us in res["plan_1_block_us_by_layers"].items()))
    if res["idle_cpu_percent_prefill"] is not None:
        print(f"idle servers: prefill {res['idle_cpu_percent_prefill']:.1f} % CPU, decode "
              f"{res['idle_cpu_percent_decode']:.1f} % CPU")


def write_json(res: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=2) + "\n")
