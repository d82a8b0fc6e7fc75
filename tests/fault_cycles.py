"""The fault cycle the engine-level fault matrix runs (kvsvc/service/faults.py), shared by
vLLM's rows (tests/vllm/test_chaos_engines.py) and SGLang's (tests/sglang/test_chaos_engines.py).

Requests go one at a time, so the i-th request is the decode server's i-th transfer and the
prefill server's i-th lease: each gets the point at i % 8 of CYCLE (D's points on D, P's on
P), at most one fault per request, the last two of each eight none. The same value of
KVSVC_FAULTS serves both servers: each takes only its own points.
"""

from __future__ import annotations

from kvsvc.service.faults import D_POINTS, NONE, P_POINTS, STREAM_POINTS

CYCLE = ["read_error", "cancel_mid_read", "claim_lost", "corrupt_landed", "lease_released", "block_rewritten",
         NONE, NONE]
# The matrix's requests are pulled: a point only a stream meets has its own test
# (stream_stalled: tests/vllm/test_progressive.py, a P killed mid-stream; wait_unanswered:
# tests/e2e/test_progressive.py, D asking again).
assert set(CYCLE) - {NONE} == (D_POINTS | P_POINTS) - STREAM_POINTS, "every fault point is in the matrix"
# The typed error each point ends its transfer with (tests/e2e/test_faults.py pins them);
# both content points end DIGEST_MISMATCH.
REASONS = {"read_error": "NIXL_ERROR", "cancel_mid_read": "CANCELLED", "claim_lost": "PEER_UNAVAILABLE",
           "lease_released": "LEASE_EXPIRED"}
DIGEST_POINTS = ("corrupt_landed", "block_rewritten")
ENV = ",".join(CYCLE)


def fault_of(i: int) -> str:
    """The fault of the i-th request ("-": none)."""
    return CYCLE[i % len(CYCLE)]


def expected_faults(n: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in range(n):
        if fault_of(i) != NONE:
            out[fault_of(i)] = out.get(fault_of(i), 0) + 1
    return out
