"""`kvsvc bench` as a user runs it: real servers, every path, JSON with the documented keys, PNG charts.

Nothing here asserts on time: the figures are the benchmark's business. What must hold is
that the run completes, checks the bytes it moved, and writes what it says it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_writes_figures_and_charts(tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsvc.cli.main", "bench", "--max-mib", "0.5", "--runs", "2", "--requests", "16",
         "--concurrency", "1,4", "--json", str(out), "--plot", str(plots)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    for key in ("kvsvc_transfer_gbps", "raw_nixl_gbps", "memcpy_gbps", "overhead_p50_ms", "transfers_per_s",
                "cold_over_warm", "kvsvc_over_raw_nixl_shuffled", "kvsvc_over_raw_nixl_contiguous",
                "grpc_round_trip_p50_ms", "idle_cpu_percent_prefill"):
        assert res[key] is not None, key
    assert res["verified"] is True and res["raw_nixl_error"] == ""
    assert res["decode_copy_threads"] == 2  # the D server it started runs the default
    # 1 block and 0.5 MiB (2 blocks of 256 KiB), each shuffled and contiguous, every path measured
    assert sorted((p["blocks"], p["pattern"]) for p in res["sizes"]) == [
        (1, "contiguous"), (1, "shuffled"), (2, "contiguous"), (2, "shuffled")]
    for p in res["sizes"]:
        assert p["verified"] is True and p["bytes"] == p["blocks"] * 256 * 1024
        assert p["raw_nixl_bytes"] == p["bytes"] and p["transfer_p99_ms"] >= p["transfer_p50_ms"] > 0
        assert p["decode_cpu_s_per_gb"] >= 0 and p["prefill_cpu_s_per_gb"] >= 0
    # each level on the TransferStream (on D's transfer socket: the bench and D share this
    # host), on it over gRPC and with unary calls, side by side
    assert [(c["in_flight"], c["api"]) for c in res["concurrency"]] == [
        (1, "stream"), (1, "grpc-stream"), (1, "unary"), (4, "stream"), (4, "grpc-stream"), (4, "unary")]
    assert res["transfers_per_s_in_flight"] == 4 and res["transfer_api"] == "stream"
    assert res["transfer_carrier"] == "socket"
    for api in ("unary", "grpc_stream"):
        assert res[f"transfers_per_s_{api}"] > 0 and res[f"overhead_p50_ms_{api}"] is not None
    assert sorted(res["plan_1_block_us_by_layers"], key=int) == ["4", "32", "80"]
    assert all(us > 0 for us in res["plan_1_block_us_by_layers"].values())
    # progress on stderr, one line per step; the table on stdout
    assert proc.stderr.count("bench [") >= 8, proc.stderr
    assert "in flight" in proc.stdout and "cold vs warm" in proc.stdout and "planning a 1-block request" in proc.stdout
    for name in ("bandwidth.png", "latency.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
