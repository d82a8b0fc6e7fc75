"""Which UCX transports a process's transfers actually use, read from UCX's own protocol log.

UCX prints its protocol selection (per peer and operation: which transport serves
which message sizes) when UCX_PROTO_INFO=y. kvsvc points that output at a private log
file at start-up, unless the operator configured UCX logging, and parses it on demand.
This is how a silent fallback of READs to TCP becomes visible in GetInfo.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvsvc.tempdirs import temp_root

log = logging.getLogger(__name__)

_OPS = (("remote memory read", "rma_get"), ("remote memory write", "rma_put"), ("active message", "am"))
_ROW = re.compile(r"\|\s*[\d.]+(?:\.\.[\w.]+)?\s*\|[^|]*\|\s*([^|]+?)\s*\|")


_OWNER = "KVSVC_UCX_LOG_OWNER"
# kvsvc-ucx-<pid>-<mkdtemp suffix> (a directory), or kvsvc-ucx-<pid>.log (older versions' file).
_ORPHAN = re.compile(r"kvsvc-ucx-(\d+)(?:-([a-z0-9_]+)|\.log)")


LOG_DIR_PREFIX = "kvsvc-ucx-"
LOG_NAME = "ucx.log"

# This process's protocol log once set up (UCX reads its settings once per process), and the
# settings kvsvc put in os.environ for UCX to read, to take out again once it has.
_active: Path | None = None
_set_by_us: dict[str, str] = {}


def enable_protocol_log() -> Path | None:
    """Route UCX's protocol selection to a private file; None when the operator set UCX logging
    or no private directory can be made (then GetInfo lists no transports, nothing else changes).

    The file lies in a directory of its own, made with mkdtemp (a new name, mode 0700), so no
    other local user can plant a link where UCX will write (UCX opens the file by name,
    following links, as root on many hosts). The settings are marked as kvsvc's own and
    taken out of the environment once UCX has read them (forget_environment); a child
    process that still inherits them (started in between) takes a file of its own instead
    of leaving them alone as if an operator had set them.
    """
    global _active
    if _active is not None:  # UCX of this process already writes there (another server of it)
        return _active
    inherited = os.environ.get(_OWNER) not in (None, str(os.getpid()))
    if not inherited and ("UCX_PROTO_INFO" in os.environ or "UCX_LOG_FILE" in os.environ):
        return None if _OWNER not in os.environ else Path(os.environ["UCX_LOG_FILE"])
    remove_orphan_logs()
    try:
        directory = tempfile.mkdtemp(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-")
    except OSError as e:
        log.warning("no private directory for UCX's protocol log in %s (%s): GetInfo will list no UCX "
                    "transports", temp_root() or "any temp dir", e)
        for name in ("UCX_PROTO_INFO", "UCX_LOG_FILE", _OWNER):
            if inherited:
                os.environ.pop(name, None)
        return None
    path = Path(directory) / LOG_NAME
    _set_by_us.update({"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(path), _OWNER: str(os.getpid())})
    os.environ.update(_set_by_us)
    _active = path
    return path


def forget_environment() -> None:
    """Take kvsvc's UCX settings out of this process's environment once UCX has read them
    (the NIXL agents exist): a process started later from this one (an engine's workers or
    compilers, another connector's engine) must not inherit a private log file that goes
    away with this server. A setting someone changed since is left as it is."""
    for name, value in _set_by_us.items():
        if os.environ.get(name) == value:
            del os.environ[name]
    _set_by_us.clear()


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


_HEADER = re.compile(r"\|\s*\S+\s+(self|intra-node|inter-node)\s+cfg#\d+\s*\|")
_READ = re.compile(r"remote memory read by .* into (\w+) memory from (\w+)")
_CONFIG = re.compile(r"\|\s*[\d.]+(?:\.\.[\w.]+)?\s*\|[^|]*\|([^|]+)\|")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[\w.:-]+)")


@dataclass(frozen=True)
class ReadPath:
    """How UCX serves READs of one class of peer: its locality as UCX sees it ("intra-node"
    or "inter-node"; "self" is a worker's own), the memory read into and from ("host",
    "cuda"), and the transports ("cma/memory", "tcp/lo", "rc_mlx5/mlx5_0:1")."""

    locality: str
    into: str
    source: str
    transports: tuple[str, ...]


def parse_read_paths(text: str) -> list[ReadPath]:
    """Every READ protocol table in UCX's protocol log, in order (one per endpoint
    configuration and memory pair UCX chose a protocol for)."""
    out: list[ReadPath] = []
    # The table being read: its peer's locality, its memory pair (a READ table), its transports.
    locality = ""
    read: tuple[str, str] | None = None
    transports: list[str] = []
    for line in text.splitlines():
        if (m := _HEADER.search(line)) is not None:
            if read is not None and transports:
                out.append(ReadPath(locality, read[0], read[1], tuple(dict.fromkeys(transports))))
            locality, read, transports = m.group(1), None, []
        elif (m := _READ.search(line)) is not None:
            read = (m.group(1), m.group(2))
        elif read is not None and (m := _CONFIG.search(line)) is not None:
            transports += _TRANSPORT.findall(m.group(1))
    if read is not None and transports:
        out.append(ReadPath(locality, read[0], read[1], tuple(dict.fromkeys(transports))))
    return out


# RDMA transports' names begin so (rc_mlx5, dc_mlx5, ud_verbs, srd, gga).
RDMA_PREFIXES = ("rc", "dc", "ud", "srd", "gga")


def degraded_because(path: ReadPath, *, require_rdma: bool) -> str:
    """Why READs on this path are a downgrade ("" when they are not): within the node over
    TCP (shared memory or CUDA IPC was possible; vLLM #51377 found exactly this), or between
    nodes without RDMA where the operator requires it."""
    names = [t.split("/", 1)[0] for t in path.transports]
    if path.locality in ("intra-node", "self"):
        if "tcp" in names:
            return (f"READs within the node from {path.source} into {path.into} memory go over TCP "
                    f"({', '.join(path.transports)}), not shared memory or CUDA IPC")
        return ""
    if require_rdma and not any(n.startswith(RDMA_PREFIXES) for n in names):
        return (f"READs between nodes from {path.source} into {path.into} memory use "
                f"{', '.join(path.transports)}, not RDMA (require_rdma_between_nodes is set)")
    return ""


def read_paths(path: Path | None) -> list[ReadPath]:
    if path is None or not path.exists():
        return []
    _flush_stdio()
    return parse_read_paths(path.read_text(errors="replace"))


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
    """Delete the logs of kvsvc processes that died without cleaning up (kill -9); returns them.

    Only this user's directories (looked at without following links) of processes that
    are gone, holding nothing but the log; and the single files of older kvsvc versions.
    """
    removed: list[Path] = []
    where = temp_root()
    if where is None:
        return removed
    root = Path(where)
    for path in root.glob(f"{LOG_DIR_PREFIX}*"):
        m = _ORPHAN.fullmatch(path.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            st = path.lstat()
            if st.st_uid != os.getuid():
                continue
            if stat.S_ISDIR(st.st_mode):
                if m.group(2) is None or any(n != LOG_NAME for n in os.listdir(path)):
                    continue
                (path / LOG_NAME).unlink(missing_ok=True)
                path.rmdir()
            elif stat.S_ISREG(st.st_mode) and m.group(2) is None:
                path.unlink()  # an older version's single file
            else:
                continue
        except OSError:
            continue  # raced with its owner or another cleaner: leave it
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
    """Remove this process's log and its private directory (never an operator's file)."""
    if path is None or path.name != LOG_NAME or not path.parent.name.startswith(LOG_DIR_PREFIX):
        return
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()
