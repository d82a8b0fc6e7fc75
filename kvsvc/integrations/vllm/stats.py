"""The connector's figures in vLLM's own metrics: its KV-transfer log line and /metrics.

Workers record each transfer they ran (D) and each release their server reported (P);
vLLM gathers the records of every worker each step (KvsvcConnectorStats.aggregate), logs
a summary every interval (reduce) and feeds them to Prometheus (KvsvcPromMetrics). The
names sit next to vLLM's vllm:nixl_* ones and mean the same where both have them:

    vllm:kvsvc_xfer_time_seconds         D: one request's Transfer on one worker, RPC to answer
    vllm:kvsvc_wire_time_seconds         D: its NIXL reads, post to completion (slowest rank)
    vllm:kvsvc_bytes_transferred         D: bytes one Transfer read
    vllm:kvsvc_num_descriptors           D: descriptors one Transfer posted
    vllm:kvsvc_report_delay_seconds      D: a load ended -> vLLM heard of it (its next step's poll)
    vllm:kvsvc_overhead_seconds          D: a pulled Transfer's time above its READs (kvsvc's share)
    vllm:kvsvc_num_failed_transfers      D: Transfers that failed (the load is reported failed)
    vllm:kvsvc_num_cancelled_transfers   D: Transfers cancelled (the request was aborted)
    vllm:kvsvc_num_kv_consumed_reqs      P: leases a decode engine read and released
    vllm:kvsvc_num_kv_aborted_reqs       P: leases given back unread (D aborted, or P withdrew)
    vllm:kvsvc_num_kv_expired_reqs       P: leases whose TTL ran out (no decode engine came)
    vllm:kvsvc_streamed_chunks_growing   D: chunks of streamed requests read while P still prefilled
    vllm:kvsvc_streamed_chunks_final     D: chunks of streamed requests read after P's last one
    vllm:kvsvc_stream_after_final_seconds  D: a streamed Transfer, P's final commit heard -> answer
    vllm:kvsvc_layer_commits             P: partial commits of chunks completing a streamed prompt

P's counters count per worker (each worker's server holds its own lease of a request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# Lists of observations, one entry per event (vLLM ships the dict from workers to the logger).
SERIES = ("xfer_seconds", "wire_seconds", "bytes", "descriptors", "report_delay_seconds", "overhead_seconds",
          "after_final_seconds")
COUNTS = ("failed", "cancelled", "consumed", "aborted", "expired", "lease_failed", "chunks_growing", "chunks_final",
          "layer_commits")
RELEASES_COUNTED = frozenset({"consumed", "aborted", "expired"})  # how a lease ended (LeaseState values)


def _empty() -> dict[str, Any]:
    return {k: [] for k in SERIES} | {k: 0 for k in COUNTS}


@dataclass
class KvsvcConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        given = self.data or {}  # copied: the lists must not be shared with whoever passed them
        self.data = {k: list(given.get(k, ())) for k in SERIES} | {k: int(given.get(k, 0)) for k in COUNTS}

    # ---- recording (a worker) --------------------------------------------------------

    def record_transfer(self, *, xfer_s: float, wire_s: float, nbytes: int, descriptors: int) -> None:
        for key, value in zip(SERIES[:4], (xfer_s, wire_s, nbytes, descriptors), strict=True):
            self.data[key].append(value)

    def record_overhead(self, seconds: float) -> None:
        self.data["overhead_seconds"].append(seconds)

    def record_after_final(self, seconds: float) -> None:
        self.data["after_final_seconds"].append(seconds)

    def record_report_delay(self, seconds: float) -> None:
        self.data["report_delay_seconds"].append(seconds)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    # ---- vLLM's interface ------------------------------------------------------------

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in SERIES) and not any(self.data[k] for k in COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in SERIES:
            self.data[k].extend(other.data.get(k, ()))
        for k in COUNTS:
            self.data[k] += int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        xfer, wire, nbytes = self.data["xfer_seconds"], self.data["wire_seconds"], self.data["bytes"]
        n = len(xfer)
        out: dict[str, int | float] = {"Num successful transfers": n}
        if n:
            ordered = sorted(xfer)
            out |= {
                "Avg xfer time (ms)": round(1e3 * sum(xfer) / n, 3),
                "P90 xfer time (ms)": round(1e3 * ordered[min(n - 1, (9 * n) // 10)], 3),
                "Avg wire time (ms)": round(1e3 * sum(wire) / n, 3),
                "Avg MB per transfer": round(sum(nbytes) / n / 2**20, 3),
                "Throughput (MB/s)": round(sum(nbytes) / 2**20 / max(sum(wire), 1e-9), 3),
                "Avg number of descriptors": round(sum(self.data["descriptors"]) / n, 1),
            }
        delays = self.data["report_delay_seconds"]
        if delays:
            out["Avg report delay (ms)"] = round(1e3 * sum(delays) / len(delays), 3)
        overhead = self.data["overhead_seconds"]
        if overhead:
            out["Avg kvsvc overhead (ms)"] = round(1e3 * sum(overhead) / len(overhead), 3)
        out |= {"Num failed transfers": self.data["failed"], "Num cancelled transfers": self.data["cancelled"],
                "Num KV consumed reqs": self.data["consumed"], "Num KV aborted reqs": self.data["aborted"],
                "Num KV expired reqs": self.data["expired"], "Num failed leases": self.data["lease_failed"]}
        if self.data["chunks_growing"] or self.data["chunks_final"]:
            out |= {"Streamed chunks read while P prefilled": self.data["chunks_growing"],
                    "Streamed chunks read after": self.data["chunks_final"]}
        after = self.data["after_final_seconds"]
        if after:
            out["Avg streamed transfer after P's prefill (ms)"] = round(1e3 * sum(after) / len(after), 3)
        return out


class KvsvcPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self._series = {
            "xfer_seconds": self._histogram("vllm:kvsvc_xfer_time_seconds",
                                            "Time of one kvsvc Transfer on one decode worker, call to answer.",
                                            seconds),
            "wire_seconds": self._histogram("vllm:kvsvc_wire_time_seconds",
                                            "Time of one kvsvc Transfer's NIXL reads, post to completion.", seconds),
            "bytes": self._histogram("vllm:kvsvc_bytes_transferred", "Bytes read by one kvsvc Transfer.",
                                     [2 ** (10 + i) for i in range(1, 25, 2)]),
            "descriptors": self._histogram("vllm:kvsvc_num_descriptors", "Descriptors posted by one kvsvc Transfer.",
                                           [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000, 20000]),
            "report_delay_seconds": self._histogram(
                "vllm:kvsvc_report_delay_seconds", "From a decode worker's load ending to vLLM hearing of it (vLLM "
                "asks once per engine step): the engine's share of the handover.", seconds),
            "overhead_seconds": self._histogram(
                "vllm:kvsvc_overhead_seconds", "A pulled kvsvc Transfer's time above its NIXL reads (call to answer "
                "minus the slowest rank's reads: claim, plan, confirm): kvsvc's share of the handover. Streamed "
                "transfers, whose call waits for the prefill, are not counted.",
                [0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1]),
            "after_final_seconds": self._histogram(
                "vllm:kvsvc_stream_after_final_seconds", "A streamed kvsvc Transfer's time after the decode "
                "worker heard of the prefill's final commit, to its answer (the last chunk's reads and the "
                "confirm): the part of the transfer not hidden behind the prefill.", seconds),
        }
        self._counts = {
            "failed": self._counter("vllm:kvsvc_num_failed_transfers",
                                    "kvsvc Transfers that failed (vLLM then fails or recomputes the request)."),
            "cancelled": self._counter("vllm:kvsvc_num_cancelled_transfers",
                                       "kvsvc Transfers cancelled because their request was aborted."),
            "consumed": self._counter("vllm:kvsvc_num_kv_consumed_reqs",
                                      "Prefill leases read and released by a decode engine (per worker)."),
            "aborted": self._counter("vllm:kvsvc_num_kv_aborted_reqs",
                                     "Prefill leases given back unread (per worker)."),
            "expired": self._counter("vllm:kvsvc_num_kv_expired_reqs",
                                     "Prefill leases whose TTL ran out before a decode engine read them "
                                     "(per worker). Same meaning as vllm:nixl_num_kv_expired_reqs."),
            "lease_failed": self._counter("vllm:kvsvc_num_failed_leases",
                                          "Finished prefills a worker's server could not lease (their blocks "
                                          "were freed; the decode engine's transfer fails at once)."),
            "chunks_growing": self._counter("vllm:kvsvc_streamed_chunks_growing",
                                            "Chunks of streamed requests a decode worker read while the prefill "
                                            "engine still computed the request (transfer hidden behind prefill)."),
            "chunks_final": self._counter("vllm:kvsvc_streamed_chunks_final",
                                          "Chunks of streamed requests a decode worker read after the prefill "
                                          "engine's last one."),
            "layer_commits": self._counter("vllm:kvsvc_layer_commits",
                                           "Partial commits (some layers) of the chunks completing streamed "
                                           "prompts, made while the forward computed the rest (per worker)."),
        }

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
        metric = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=self._labelnames)
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def _counter(self, name: str, doc: str) -> dict[int, Any]:
        metric = self._counter_cls(name=name, documentation=doc, labelnames=self._labelnames)
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._series.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self._counts.items():
            if transfer_stats_data.get(key):
                per_engine[engine_idx].inc(transfer_stats_data[key])
