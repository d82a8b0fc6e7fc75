"""benchmarks/vllm_stream.py: its table from samples, and (make test-full) one short real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.vllm_stream import OVERHEAD_LE, p50_at_most, summary, table
from tests.hosts.harness import available


def _sample(ttft: float, p_done: float) -> dict[str, float]:
    return {"ttft": ttft, "p_done": p_done, "tail": ttft - p_done}


def _cell(xfer_ms: list[float], after_ms: list[float]) -> dict[str, float]:
    return {"xfer_sum": sum(xfer_ms) / 1e3, "xfer_count": len(xfer_ms), "after_final_sum": sum(after_ms) / 1e3,
            "after_final_count": len(after_ms)}


def test_the_table_joins_both_kvsvc_runs_and_gives_the_tail_and_the_transfer_hidden():
    results = {"cells": ["1024x1"], "rounds": 2,
               "kvsvc": {"samples": {"pull 1024 x1": [_sample(0.30, 0.20)], "stream 1024 x1": [_sample(0.25, 0.22)]},
                         "per_cell": {"pull 1024 x1": _cell([40], []), "stream 1024 x1": _cell([300], [4])}},
               "nixl": {"samples": {"nixl 1024 x1": [_sample(0.60, 0.50), _sample(0.70, 0.58)]}},
               "kvsvc-again": {"samples": {"pull 1024 x1": [_sample(0.32, 0.22)],
                                           "stream 1024 x1": [_sample(0.26, 0.23)]},
                               "per_cell": {"pull 1024 x1": _cell([60], []), "stream 1024 x1": _cell([310], [6])}}}
    rows = table(results, [(1024, 1)]).splitlines()
    assert len(rows) == 3
    # pull: tails 100 and 100 ms; stream: 30 and 30 ms: 70 % of the tail hidden; NixlConnector's
    # p50 of two. Pulled transfers 40 and 60 ms (mean 50); streamed, 4 and 6 ms after P's final
    # commit (mean 5; their whole calls, which waited for the prefill, do not count): 90 % hidden.
    assert rows[2] == ("| 1,024 | 1 | 310 (320) ms | 255 (260) ms | 650 (700) ms | 100 ms | 30 ms | 110 ms | 70 % | "
                       "50 ms | 5 ms | 90 % |")
    assert summary([_sample(0.3, 0.2)])["n"] == 1


def test_a_cell_without_the_connectors_figures_leaves_the_transfer_hidden_out():
    results = {"kvsvc": {"samples": {"pull 4096 x1": [_sample(0.5, 0.3)], "stream 4096 x1": [_sample(0.4, 0.35)]},
                         "per_cell": {"pull 4096 x1": _cell([], []), "stream 4096 x1": _cell([], [])}},
               "nixl": {"samples": {"nixl 4096 x1": [_sample(0.9, 0.6)]}}}
    assert table(results, [(4096, 1)]).splitlines()[2].endswith("| 75 % | -- | -- | -- |")


def test_a_pair_committing_the_last_chunk_whole_adds_its_transfer_hidden_and_no_nixl_pair_shows_dashes():
    results = {"kvsvc": {"samples": {"pull 4096 x1": [_sample(0.5, 0.3)], "stream 4096 x1": [_sample(0.4, 0.35)]},
                         "per_cell": {"pull 4096 x1": _cell([50], []), "stream 4096 x1": _cell([400], [5])}},
               "kvsvc-chunks": {"samples": {"pull 4096 x1": [_sample(0.5, 0.3)],
                                            "stream-chunks 4096 x1": [_sample(0.41, 0.35)]},
                                "per_cell": {"pull 4096 x1": _cell([50], []), "stream-chunks 4096 x1": _cell([410],
                                                                                                            [15])}}}
    rows = table(results, [(4096, 1)]).splitlines()
    # Pulled 50 ms; streamed 5 ms after P's final commit (90 % hidden), 15 ms with the last chunk whole (70 %).
    assert rows[0].endswith("| streamed after prefill, last chunk whole | hidden |")
    assert rows[2] == "| 4,096 | 1 | 500 (500) ms | 400 (400) ms | -- | 200 ms | 50 ms | -- | 75 % | 50 ms | 5 ms | " \
        "90 % | 15 ms | 70 % |"


@pytest.mark.full
@pytest.mark.timeout(1800)
@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_short_run_measures_every_mode_across_two_hosts(tmp_path):
    out = tmp_path / "stream.json"
    subprocess.run([sys.executable, "-m", "benchmarks.vllm_stream", "--cells", "1024x1", "--rounds", "1",
                    "--json", str(out)], check=True, timeout=1700)
    got = json.loads(out.read_text())
    assert {"pull 1024 x1", "stream 1024 x1"} <= set(got["kvsvc"]["samples"]) and got["nixl"]["samples"]
    assert got["kvsvc"]["per_mode"]["stream"]["chunks_read_growing"] + \
        got["kvsvc"]["per_mode"]["stream"]["chunks_read_final"] >= 1
    assert not any(got[r]["threads_off_cpu_after"][s] for r in ("kvsvc", "nixl") for s in ("p", "d"))
    streamed = got["kvsvc"]["per_cell"]["stream 1024 x1"]
    assert streamed["after_final_count"] >= 1 and streamed["after_final_sum"] < streamed["xfer_sum"]


def test_a_histograms_p50_is_read_off_the_first_bucket_holding_half():
    c = {f"overhead_le_{b}": n for b, n in zip(OVERHEAD_LE, [0, 1, 3, 4, 6, 9, 10, 10, 10, 10, 10, 10, 10],
                                              strict=True)}
    assert p50_at_most(c, "overhead", OVERHEAD_LE) == "2"  # 6 of 10 at most 2 ms, 4 at most 1.5
    assert p50_at_most(dict.fromkeys(c, 0.0), "overhead", OVERHEAD_LE) is None  # no samples
