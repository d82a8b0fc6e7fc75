"""What the benchmark counts with: percentiles, bandwidth, CPU time of a process, progress lines."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of xs; 0.0 for no samples."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0


def ms(xs: Sequence[float], q: float) -> float:
    """A percentile of durations in seconds, in milliseconds."""
    return 1e3 * pct(xs, q)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used by some processes between start() and stop() (empty: nothing measured)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) - self._before[name] for name, pid in self.pids.items()}


class Progress:
    """One line per step on stderr, so a long run shows where it is (quiet: nothing)."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.started = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.quiet:
            print(f"bench [{self.done}/{self.total}, {time.monotonic() - self.started:.0f} s] {what}",
                  file=sys.stderr, flush=True)
