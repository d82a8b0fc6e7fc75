"""Which UCX transports a process's transfers actually use, read from UCX's own protocol log.

UCX prints its protocol selection (per peer and operation: which transport serves
which message sizes) when UCX_PROTO_INFO=y. kvsvc points that output at a private log
file at start-up, unless the operator configured UCX logging, and parses it on demand.
This is how a silent fallback of READs to TCP becomes visible in GetInfo.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from pathlib import Path

_OPS = (("remote memory read", "rma_get"), ("remote memory write", "rma_put"), ("active message", "am"))
_ROW = re.compile(r"\|\s*[\d.]+(?:\.\.[\w.]+)?\s*\|[^|]*\|\s*([^|]+?)\s*\|")


_OWNER = "KVSVC_UCX_LOG_OWNER"


def enable_protocol_log() -> Path | None:
    """Route UCX's protocol selection to a private file; None when the operator set UCX logging.

    The settings are marked as kvsvc's own, so a child process (a server started by a
    test or the demo) that inherits them takes a file of its own instead of leaving
    them alone as if an operator had set them.
    """
    inherited = os.environ.get(_OWNER) not in (None, str(os.getpid()))
    if not inherited and ("UCX_PROTO_INFO" in os.environ or "UCX_LOG_FILE" in os.environ):
        return None if _OWNER not in os.environ else Path(os.environ["UCX_LOG_FILE"])
    remove_orphan_logs()
    path = Path(tempfile.gettempdir()) / f"kvsvc-ucx-{os.getpid()}.log"
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = str(path)
    os.environ[_OWNER] = str(os.getpid())
    return path


def parse_transports(text: str) -> list[str]:
    """'op:transport/device' entries, e.g. 'rma_get:cma/memory', 'am:tcp/lo'."""
    seen: set[str] = set()
    op = ""
    for line in text.splitlines():
        for needle, name in _OPS:
            if needle in line:
                op = name
                break
        else:
            m = _ROW.search(line)
            if m and op:
                for part in m.group(1).split(","):
                    part = part.strip()
                    if part and "/" in part:
                        seen.add(f"{op}:{part.split()[-1] if ' ' in part else part}")
    return sorted(seen)


def read_transports(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    _flush_stdio()
    return parse_transports(path.read_text(errors="replace"))


def _flush_stdio() -> None:
    """UCX writes its log through a buffered FILE*; fflush(NULL) pushes every stdio stream out."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def remove_orphan_logs() -> list[Path]:
    """Delete the logs of kvsvc processes that died without cleaning up (kill -9); returns them."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("kvsvc-ucx-*.log"):
        pid = path.stem.removeprefix("kvsvc-ucx-")
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_log(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
