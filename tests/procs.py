"""Helper processes the tests start (etcd, Prometheus): stopped the same way."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
