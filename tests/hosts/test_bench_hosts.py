"""`make bench-hosts` as a user runs it, small: P and D on two hosts, the bench on D's host,
every path measured over the link, the bytes checked, the JSON written. No time asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_across_hosts_runs_every_path_over_the_link(tmp_path):
    out = tmp_path / "hosts.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hosts", "--max-mib", "0.5", "--runs", "2", "--requests", "8",
         "--concurrency", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["verified"] is True, "the check transfer after the run moved the right bytes"
    assert res["raw_nixl_error"] == "" and all(p["raw_nixl_bytes"] == p["bytes"] for p in res["sizes"])
    assert any(t.startswith("rma_get:tcp/") for t in res["ucx_transports"]), res["ucx_transports"]
    assert not any(t.startswith("rma_get:cma/") for t in res["ucx_transports"]), "no same-host READs between hosts"
    assert res["grpc_round_trip_p50_ms_prefill"] > 0 and res["hosts"]["overhead_in_round_trips"] is not None
    assert all(p["verified"] is None for p in res["sizes"]), "P's pool is on another host: not mapped by the bench"


def test_the_progressive_bench_runs_both_modes_over_the_link_and_checks_the_bytes(tmp_path):
    """`make bench-progressive`, small: both modes of every length measured, one streamed
    transfer checked byte for byte. No time asserted."""
    out = tmp_path / "progressive.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.progressive", "--tokens", "512,1040", "--chunk-tokens", "256",
         "--runs", "1", "--layers", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["verified"] is True
    assert sorted(res["by_prompt_tokens"]) == ["1040", "512"]
    for row in res["by_prompt_tokens"].values():
        assert row["tail_ms_whole_p50"] > 0 and row["tail_ms_progressive_p50"] > 0
