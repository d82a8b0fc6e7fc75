"""The connector's stats as vLLM handles them: rebuilt from a worker's dict, aggregated, reduced
for the log line, and observed into Prometheus metrics (a registry of the test's own)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.integrations.vllm.connector import KvsvcConnector


def one_worker_step():
    s = KvsvcConnector.build_kv_connector_stats()
    s.record_transfer(xfer_s=0.010, wire_s=0.004, nbytes=2**20, descriptors=3)
    s.record_report_delay(0.002)
    s.record_overhead(0.0015)
    s.record_after_final(0.003)
    s.count("chunks_growing", 3)
    s.count("consumed")
    s.count("cancelled")
    return s


def test_aggregate_and_reduce_without_sharing_lists():
    a = one_worker_step()
    b = KvsvcConnector.build_kv_connector_stats(a.to_dict())  # as vLLM rebuilds it from the dict
    b.aggregate(a)
    assert a.reduce()["Num successful transfers"] == 1  # a is not changed by b's aggregation
    r = b.reduce()
    assert r["Num successful transfers"] == 2
    assert r["Avg xfer time (ms)"] == 10.0 and r["Avg wire time (ms)"] == 4.0
    assert r["Avg MB per transfer"] == 1.0 and r["Throughput (MB/s)"] == 250.0  # 2 MiB over 8 ms of wire
    assert (r["Num KV consumed reqs"], r["Num cancelled transfers"], r["Num failed transfers"]) == (2, 2, 0)
    assert r["Avg kvsvc overhead (ms)"] == 1.5 and r["Avg streamed transfer after P's prefill (ms)"] == 3.0
    assert r["Avg report delay (ms)"] == 2.0 and r["Streamed chunks read while P prefilled"] == 6
    assert not b.is_empty() and KvsvcConnector.build_kv_connector_stats().is_empty()


def test_prometheus_metrics_carry_the_observations():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KvsvcConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                             ["model_name", "engine"], {0: ["m", "0"]})
    stats = one_worker_step().aggregate(one_worker_step())
    prom.observe(stats.to_dict(), engine_idx=0)
    got = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
           for s in f.samples if not s.name.endswith("_created") and "le" not in s.labels}
    assert got["vllm:kvsvc_xfer_time_seconds_count"] == 2
    assert abs(got["vllm:kvsvc_xfer_time_seconds_sum"] - 0.020) < 1e-9
    assert got["vllm:kvsvc_bytes_transferred_sum"] == 2 * 2**20
    assert got["vllm:kvsvc_num_descriptors_sum"] == 6
    assert got["vllm:kvsvc_num_kv_consumed_reqs_total"] == 2
    assert got["vllm:kvsvc_num_cancelled_transfers_total"] == 2
    assert got["vllm:kvsvc_num_kv_expired_reqs_total"] == 0
    assert abs(got["vllm:kvsvc_report_delay_seconds_sum"] - 0.004) < 1e-9
    assert got["vllm:kvsvc_streamed_chunks_growing_total"] == 6
    assert abs(got["vllm:kvsvc_overhead_seconds_sum"] - 0.003) < 1e-9
    assert got["vllm:kvsvc_stream_after_final_seconds_count"] == 2
    buckets = {s.labels["le"]: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.name == "vllm:kvsvc_overhead_seconds_bucket"}
    assert (buckets["0.001"], buckets["0.0015"], buckets["0.002"]) == (0, 2, 2)  # the 2 ms goal reads off a bucket
