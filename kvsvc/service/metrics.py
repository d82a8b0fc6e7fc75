"""Prometheus metrics of one server: its own registry (several servers may share a process),
served over HTTP by `kvsvc serve --metrics-listen HOST:PORT` ([server] metrics_listen).

Names are kvsvc_*, labelled with this server's engine and, where it matters, the peer
engine. What vLLM's NIXL connector exports (vllm:nixl_xfer_time_seconds,
vllm:nixl_bytes_transferred, vllm:nixl_num_failed_transfers, ...) maps onto
kvsvc_transfer_seconds, kvsvc_transfer_bytes_total and kvsvc_transfers_total{outcome="failed"}.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# 0.1 ms to 60 s: a 1-block READ on shared memory to a long request over a busy link.
SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# What makes a failed transfer a NIXL error (the data plane failed, not a lease or input).
NIXL_REASONS = frozenset({Reason.NIXL_ERROR, Reason.TRANSFER_FAILED, Reason.DATA_PLANE_UNAVAILABLE})
# Label values come from requests (engine ids in params, reasons in peers' answers): past
# this many distinct values per label the rest count as "other", so no caller can grow
# the registry without bound.
MAX_LABEL_VALUES = 256


class Metrics:
    """Every metric of one server, registered in a registry of its own."""

    def __init__(self, engine_id: str) -> None:
        self.engine = engine_id
        r = self.registry = CollectorRegistry()
        self._transfers = Counter("kvsvc_transfers", "Transfers this D server ran, by outcome (ok, failed) and "
                                  "error reason", ["engine", "peer_engine", "outcome", "reason"], registry=r)
        self._bytes = Counter("kvsvc_transfer_bytes", "Bytes read by successful transfers",
                              ["engine", "peer_engine"], registry=r)
        self._descriptors = Counter("kvsvc_transfer_descriptors", "NIXL descriptors posted by successful transfers",
                                    ["engine", "peer_engine"], registry=r)
        self._seconds = Histogram("kvsvc_transfer_seconds", "Transfer time, end to end on the D server",
                                  ["engine", "peer_engine"], buckets=SECONDS, registry=r)
        self._phases = Histogram("kvsvc_transfer_phase_seconds", "Transfer phases on the D server: plan, post "
                                 "(READs handed to NIXL), reads (READs and the claim done), confirm (CONSUMED "
                                 "answered)", ["engine", "phase"], buckets=SECONDS, registry=r)
        self._wire = Histogram("kvsvc_transfer_wire_seconds", "READs of a transfer from post to completion (the "
                               "slowest rank)", ["engine"], buckets=SECONDS, registry=r)
        self._lease_calls = Histogram("kvsvc_lease_call_seconds", "Claim and confirm round trips to P servers",
                                      ["engine", "call"], buckets=SECONDS, registry=r)
        self._handshakes = Counter("kvsvc_handshakes", "Handshakes with P servers, by outcome",
                                   ["engine", "peer_engine", "outcome"], registry=r)
        self._peer_transports = Gauge("kvsvc_peer_read_transport", "READs from a P server use this UCX transport "
                                      "(1); degraded: a downgrade, reason TRANSPORT_DEGRADED (GetInfo says why)",
                                      ["engine", "peer_engine", "transport", "degraded"], registry=r)
        self._content = Counter("kvsvc_content_checked_blocks", "P blocks whose content digest D checked against "
                                "what landed (result: checked, unchecked -- not read whole, or P sent none -- "
                                "or mismatch: the transfer failed DIGEST_MISMATCH)", ["engine", "result"], registry=r)
        self._faults = Counter("kvsvc_injected_faults", "Faults this server injected (KVSVC_FAULTS: tests only)",
                               ["engine", "point"], registry=r)
        self._rehandshakes = Counter("kvsvc_rehandshakes", "Handshakes again because a P server restarted",
                                     ["engine"], registry=r)
        self._nixl_errors = Counter("kvsvc_nixl_errors", "Transfers that failed in the data plane (NIXL/UCX)",
                                    ["engine"], registry=r)
        self._releases = Counter("kvsvc_lease_releases", "Leases this P server released, by reason (consumed, "
                                 "expired, aborted)", ["engine", "reason"], registry=r)
        self._commits = Counter("kvsvc_commits", "Chunks committed to progressive leases on this P server "
                                "(final: the last of a lease)", ["engine", "final"], registry=r)
        self._progressive_reads = Counter("kvsvc_progressive_reads", "Chunks D read of progressive leases, by "
                                          "when (growing: before P's final commit; final: after it)",
                                          ["engine", "when"], registry=r)
        self._after_final = Histogram("kvsvc_progressive_after_final_seconds", "Progressive transfers on the D "
                                      "server: from hearing of P's final commit to the answer (the last chunk's "
                                      "READs and the confirm) -- the part not hidden behind P's prefill",
                                      ["engine"], buckets=SECONDS, registry=r)
        self._waits_unanswered = Counter("kvsvc_commit_waits_unanswered", "Waits for a progressive lease's next "
                                         "commit that its P server did not answer in time (a stalled or stopped "
                                         "P; asked again while its lease holds)", ["engine"], registry=r)
        self._gauges: list[Gauge] = []
        self._http: Any = None
        self._seen: dict[str, set[str]] = {"peer_engine": set(), "reason": set()}
        # Labelled children, looked up once: prometheus_client's labels() validates and
        # locks on every call, ten of them per transfer (bounded as the label values are).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Counters of rare events exist at 0 from the start: a series that appears only with its
        # first event hides that event from rate() and increase(), and from the alerts on them.
        self._child(self._nixl_errors, self.engine)
        self._child(self._rehandshakes, self.engine)
        self._child(self._waits_unanswered, self.engine)
        for reason in ("consumed", "expired", "aborted"):
            self._child(self._releases, self.engine, reason)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _bounded(self, label: str, value: str) -> str:
        seen = self._seen[label]
        if value in seen:
            return value
        if len(seen) >= MAX_LABEL_VALUES:
            return "other"
        seen.add(value)
        return value

    # ---- what the server reports ------------------------------------------------------

    def transfer_ok(self, peer_engine: str, seconds: float, nbytes: int, descriptors: int, wire_s: float) -> None:
        peer_engine = self._bounded("peer_engine", peer_engine)
        self._child(self._transfers, self.engine, peer_engine, "ok", "").inc()
        self._child(self._bytes, self.engine, peer_engine).inc(nbytes)
        self._child(self._descriptors, self.engine, peer_engine).inc(descriptors)
        self._child(self._seconds, self.engine, peer_engine).observe(seconds)
        self._child(self._wire, self.engine).observe(wire_s)

    def transfer_failed(self, peer_engine: str, reason: str) -> None:
        self._child(self._transfers, self.engine, self._bounded("peer_engine", peer_engine), "failed",
                    self._bounded("reason", reason)).inc()
        if reason in NIXL_REASONS:
            self._child(self._nixl_errors, self.engine).inc()

    def phases(self, marks: Sequence[tuple[str, float]], started: float) -> None:
        prev = started
        for name, at in marks:
            self._child(self._phases, self.engine, name).observe(at - prev)
            prev = at

    def lease_call(self, call: str, seconds: float) -> None:
        self._child(self._lease_calls, self.engine, call).observe(seconds)

    def handshake(self, peer_engine: str, ok: bool) -> None:
        self._child(self._handshakes, self.engine, self._bounded("peer_engine", peer_engine), "ok" if ok else "failed").inc()

    def peer_transport(self, known: pb.PeerTransport) -> None:
        peer = self._bounded("peer_engine", known.engine_id)
        for transport in known.read_transports:
            self._child(self._peer_transports, self.engine, peer, transport,
                        "true" if known.warning_reason else "false").set(1)

    def content_checked(self, checked: int, unchecked: int) -> None:
        self._child(self._content, self.engine, "checked").inc(checked)
        self._child(self._content, self.engine, "unchecked").inc(unchecked)

    def committed(self, final: bool) -> None:
        self._child(self._commits, self.engine, "true" if final else "false").inc()

    def progressive_after_final(self, seconds: float) -> None:
        self._child(self._after_final, self.engine).observe(seconds)

    def progressive_read(self, growing: bool) -> None:
        self._child(self._progressive_reads, self.engine, "growing" if growing else "final").inc()

    def commit_wait_unanswered(self) -> None:
        self._child(self._waits_unanswered, self.engine).inc()

    def content_mismatch(self) -> None:
        self._child(self._content, self.engine, "mismatch").inc()

    def fault_injected(self, point: str) -> None:
        self._child(self._faults, self.engine, point).inc()

    def rehandshake(self) -> None:
        self._child(self._rehandshakes, self.engine).inc()

    def released(self, reason: str) -> None:
        self._child(self._releases, self.engine, reason).inc()

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A value read when scraped (live leases, peers, ...)."""
        g = Gauge(name, doc, ["engine"], registry=self.registry)
        g.labels(self.engine).set_function(read)
        self._gauges.append(g)

    # ---- serving ----------------------------------------------------------------------

    def serve(self, listen: str) -> str:
        """Serve /metrics on host:port (port 0: any free port) from a thread; returns host:port."""
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), host or "0.0.0.0", registry=self.registry)
        self._http = server
        return f"{host or '0.0.0.0'}:{server.server_port}"

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
