"""Faults injected at exact points, for tests of the engines above kvsvc (the engine-level
fault matrix: tests/vllm/test_chaos_engines.py, docs/RELIABILITY.md).

Off unless the environment names them. KVSVC_FAULTS is a cycle of fault points, one per
transfer a decode server runs (or lease a prefill server makes), counted from the server's
start: "read_error,-,-,lease_released" gives the 1st, 5th, 9th... transfer a failed READ and
the 4th, 8th... lease a release under D's READ; "-" is no fault. A server with faults on
warns at start, lists "faults" in GetInfo's capabilities and counts every fault it injected
(kvsvc_injected_faults_total{point}). Never set it in production.

Each point stands for a class of failure peers ship (the issue each models is in
RELIABILITY.md's table):

- D's: read_error (a READ fails after it was posted), cancel_mid_read (D gives the transfer
  up while its READs run), claim_lost (the answer to D's claim never comes back: P may have
  taken it), corrupt_landed (a byte of what landed is flipped: a torn or misdirected READ).
- P's: lease_released (the lease is released while D reads: expiry, a router's abort),
  block_rewritten (the engine writes into a leased block after the lease was made; on a
  progressive lease, into the first block a commit made whole, once its digest was taken),
  stream_stalled (a progressive lease takes its first chunk and no later commit reaches D:
  P's engine hung mid-prefill -- a wedged worker, a stuck device; the commits are answered
  as made and dropped, so the engine goes on and a test can kill P while D waits on a
  growing lease), wait_unanswered (the first wait for a progressive lease's next commit after
  D read something is never answered -- held until the caller's own deadline ends it: P's
  event loop stalled for seconds, a busy host or a long pause; the lease and its commits go
  on). A lease made whole ignores both.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

log = logging.getLogger(__name__)

ENV = "KVSVC_FAULTS"
D_POINTS = frozenset({"read_error", "cancel_mid_read", "claim_lost", "corrupt_landed"})
P_POINTS = frozenset({"lease_released", "block_rewritten", "stream_stalled", "wait_unanswered"})
STREAM_POINTS = frozenset({"stream_stalled", "wait_unanswered"})  # points only a progressive lease meets
NONE = "-"
MAX_CYCLE = 1024


class Faults:
    """Which fault (if any) the next transfer or lease gets, and how many were injected."""

    def __init__(self, cycle: Sequence[str]) -> None:
        unknown = sorted(set(cycle) - D_POINTS - P_POINTS - {NONE})
        if unknown or not cycle or len(cycle) > MAX_CYCLE:
            raise ValueError(f"{ENV}: unknown fault points {unknown} (known: {sorted(D_POINTS | P_POINTS)}, "
                             f"and {NONE!r} for none), or not 1 to {MAX_CYCLE} of them")
        self.cycle = tuple(cycle)
        self._transfers = self._leases = 0
        self.injected: Counter[str] = Counter()
        self.on_inject: Callable[[str], None] = lambda _point: None  # e.g. the metric

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> Faults | None:
        spec = env.get(ENV, "").strip()
        if not spec:
            return None
        faults = cls([p.strip() for p in spec.split(",")])
        log.warning("%s is set (%s): this server injects faults, for tests only", ENV, spec)
        return faults

    def _next(self, n: int, points: frozenset[str]) -> str | None:
        point = self.cycle[n % len(self.cycle)]
        return point if point in points else None

    def next_transfer(self) -> str | None:
        """D: the fault of the transfer starting now, if any."""
        point = self._next(self._transfers, D_POINTS)
        self._transfers += 1
        return point

    def next_lease(self) -> str | None:
        """P: the fault of the lease made now, if any."""
        point = self._next(self._leases, P_POINTS)
        self._leases += 1
        return point

    def injected_now(self, point: str) -> None:
        self.injected[point] += 1
        self.on_inject(point)
        log.info("injected fault %s", point)
