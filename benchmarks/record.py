"""Append one run of `kvsvc bench` (its --json file) to the run history, benchmarks/history.jsonl:
one JSON object per line with the headline figures, the commit and the date, so runs can be
compared over time without prose.   python benchmarks/record.py benchmarks/results.json LABEL"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

HISTORY = Path(__file__).with_name("history.jsonl")


def summary(results: dict, label: str) -> dict:
    by_flight = {c["in_flight"]: c["transfers_per_s"] for c in results["concurrency"]
                 if c["api"] == results["transfer_api"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HISTORY.parent).stdout.strip()
    return {
        "bench": "kvsvc bench", "date": datetime.date.today().isoformat(), "commit": commit or None, "label": label,
        "overhead_p50_ms": round(results["overhead_p50_ms"], 3),
        "overhead_p50_ms_grpc_stream": round(results["overhead_p50_ms_grpc_stream"], 3),
        "overhead_p50_ms_unary": round(results["overhead_p50_ms_unary"], 3),
        "transfers_per_s_at_1_8_32": [round(by_flight[n]) for n in (1, 8, 32) if n in by_flight],
        "cold_over_warm": round(results["cold_over_warm"], 2),
        "kvsvc_over_raw_nixl_64mib": {"shuffled": round(results["kvsvc_over_raw_nixl_shuffled"], 2),
                                      "contiguous": round(results["kvsvc_over_raw_nixl_contiguous"], 2)},
        "grpc_round_trip_ms": round(results["grpc_round_trip_p50_ms"], 3),
        "idle_cpu_percent": [results["idle_cpu_percent_prefill"], results["idle_cpu_percent_decode"]],
        "verified": results["verified"],
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/record.py RESULTS.json LABEL")
    record = summary(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
    with HISTORY.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {HISTORY}: {record}")
