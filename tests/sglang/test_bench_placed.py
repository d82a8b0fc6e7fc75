"""benchmarks/sglang_placed.py: its table from samples, and (make test-full) one short real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.sglang_placed import summary, table
from tests.hosts.harness import available


def test_the_table_joins_a_backends_runs_and_leaves_out_what_did_not_run():
    results = {"kvsvc": {"samples": {"1024x1": [{"ttft": 0.30, "p_done": 0.3}]}},
               "nixl": {"samples": {"1024x1": [{"ttft": 0.80, "p_done": 0.8}, {"ttft": 0.60, "p_done": 0.6}]}},
               "kvsvc-again": {"samples": {"1024x1": [{"ttft": 0.32, "p_done": 0.3}]}}}
    rows = table(results, ["1024x1", "4096x1"], ["kvsvc", "nixl", "kvsvc-again"]).splitlines()
    assert rows[0] == "| prompt x in flight | TTFT p50 (max): kvsvc | TTFT p50 (max): nixl |"
    assert rows[2] == "| 1024x1 | 310 (320) ms | 700 (800) ms |"  # kvsvc's two runs together
    assert rows[3] == "| 4096x1 | -- | -- |"
    assert summary([{"ttft": 0.3, "p_done": 0.25}]) == {"n": 1, "ttft_ms_p50": 300.0, "ttft_ms_max": 300.0,
                                                         "p_done_ms_p50": 250.0, "p_done_ms_max": 250.0}


@pytest.mark.full
@pytest.mark.timeout(1800)
@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_short_run_measures_every_backend_across_two_hosts(tmp_path):
    out = tmp_path / "placed.json"
    subprocess.run([sys.executable, "-m", "benchmarks.sglang_placed", "--cells", "1024x1", "--rounds", "1",
                    "--backends", "kvsvc", "kvsvc-stream", "nixl", "--json", str(out)], check=True, timeout=1700)
    got = json.loads(out.read_text())
    for backend in ("kvsvc", "kvsvc-stream", "nixl"):
        assert got[backend]["cells"]["1024x1"]["n"] == 1
        assert not got[backend]["threads_off_cpu_after"]["p"] and not got[backend]["threads_off_cpu_after"]["d"]
    assert got["kvsvc"]["kvsvc"]["transfers"] >= 1 and got["nixl"]["kvsvc"] is None
    streamed = got["kvsvc-stream"]["kvsvc"]
    assert streamed["after_final_ms_mean"] is not None and streamed["after_final_ms_mean"] < streamed["transfer_ms_mean"]
    assert got["kvsvc"]["kvsvc"]["after_final_ms_mean"] is None  # pulled: no final commit to hear of
