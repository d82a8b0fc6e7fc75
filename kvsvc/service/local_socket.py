"""A server's end of a same-host socket (kvsvc/framing.py has the framing and why).

LocalSocket listens on <temp dir>/kvsvc-<epoch>-<random>/<name>, in a directory of mode
0700, so only this server's user (and root) can connect; it removes the directory when
it closes, and the directories of servers killed without closing when it starts.
FramedConnection is one client's connection: frames are split and handed over inside the
callback that received them (no task, no coroutine, no extra loop turn per message); a
client that stops reading pauses its own connection's reading; a frame must be whole
within FRAME_TIMEOUT_S of its first byte; a frame that is too big or does not parse ends
that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.framing import SOCKET_DIR_PREFIX, SOCKET_NAMES, split_frames
from kvsvc.reasons import Reason
from kvsvc.tempdirs import temp_root

log = logging.getLogger(__name__)

# Connections at once (a D server keeps one per P server it reads from, an engine one per
# worker).
MAX_CONNECTIONS = 1024
# A frame, once its first byte came, must be whole within this long (a connection may be
# idle between frames for as long as its client keeps it).
FRAME_TIMEOUT_S = 10.0

# A server killed without stopping (SIGKILL, OOM) leaves its socket's directory behind;
# the next server to start removes such directories: kvsvc's name and mode, this user's,
# older than this (a server starting meanwhile binds within milliseconds), holding nothing
# but a socket nobody listens on.
STALE_AFTER_S = 60.0
_DIR_NAME = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"[0-9a-f]{8}-[a-z0-9_]{8}")


def remove_stale_dirs(root: str | None = None, min_age_s: float = STALE_AFTER_S) -> int:
    """Remove the socket directories of servers that are gone (see STALE_AFTER_S); how many went."""
    root = root or temp_root()
    removed = 0
    if root is None:
        return 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    for entry in entries:
        if not _DIR_NAME.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != 0o700 or st.st_uid != os.getuid()
                    or time.time() - st.st_mtime < min_age_s):
                continue
            names = os.listdir(entry.path)
            if len(names) > 1 or any(n not in SOCKET_NAMES for n in names):
                continue
            if names and _answers(os.path.join(entry.path, names[0])):
                continue  # a live server's
            shutil.rmtree(entry.path)
            removed += 1
        except OSError:
            continue  # raced with its owner or another cleaner: leave it
    if removed:
        log.info("removed %d socket directories of servers that are gone from %s", removed, root)
    return removed


def _answers(path: str) -> bool:
    """Whether something listens on the Unix socket at path (when unsure: yes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
        return True


class LocalSocket:
    """A Unix socket server in a private directory; each connection made by connection()."""

    def __init__(self, name: str, connection: Callable[[Any], FramedConnection], max_message_bytes: int,
                 epoch: int) -> None:
        self.name = name
        self._make = connection
        self.max_bytes = max_message_bytes
        self._epoch = epoch
        self._dir = ""
        self.path = ""
        self._server: asyncio.AbstractServer | None = None
        self.conns: set[FramedConnection] = set()
        self.connections_served = 0  # connections accepted so far (for tests and inspection)

    async def start(self) -> None:
        """Make the private directory and listen in it (OSError when the temp dir cannot hold it)."""
        remove_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{self._epoch & 0xFFFFFFFF:08x}-")  # mode 0700
        self.path = os.path.join(self._dir, self.name)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: self._make(self),
                                                                               path=self.path)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop accepting, end every connection, remove the socket."""
        self.stop_accepting()
        for conn in list(self.conns):
            conn.close()
        self.conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class FramedConnection(asyncio.Protocol):
    """One client's connection to a LocalSocket; subclasses take its frames (frames_received)."""

    def __init__(self, owner: LocalSocket) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._frame_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        owner = self.owner
        if len(owner.conns) >= MAX_CONNECTIONS:
            log.warning("%s: %d connections open, refusing another", owner.name, len(owner.conns))
            full = KvsvcError(Reason.SOCKET_FULL, f"{len(owner.conns)} connections are open on this server's {owner.name}, "
                              "the most it takes: use gRPC", {"connections": len(owner.conns)},
                              code=ErrorCode.RESOURCE_EXHAUSTED)
            transport.write(self.refusal(full))  # type: ignore[attr-defined]  # its client falls back to gRPC, nothing was read
            transport.close()
            return
        owner.conns.add(self)
        owner.connections_served += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.conns.discard(self)
        self._stop_timer()

    def close(self) -> None:
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()  # take no more until the client took what it was sent

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def frames_received(self, bodies: list[bytes]) -> None:
        """The whole frames that came in one read (in order)."""
        raise NotImplementedError

    def refusal(self, error: KvsvcError) -> bytes:
        """The frame that tells a client its connection was refused (the carrier's end-of-stream)."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        bodies, too_big = split_frames(buf, self.owner.max_bytes)
        if bodies:
            self.frames_received(bodies)
        if too_big:
            log.warning("%s: a %d-byte frame is over the %d-byte limit; closing", self.owner.name, too_big,
                        self.owner.max_bytes)
            return self.broken()
        # A frame, once its first byte came, must be whole within FRAME_TIMEOUT_S.
        if bodies or not buf:
            self._stop_timer()
        if buf and self._frame_timer is None and not self._closing:
            self._frame_timer = asyncio.get_running_loop().call_later(FRAME_TIMEOUT_S, self._frame_overdue)

    @property
    def _closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def eof_received(self) -> bool:
        return False  # the client closed its side: close ours

    def _frame_overdue(self) -> None:
        self._frame_timer = None
        log.warning("%s: a frame not whole after %.0f s; closing", self.owner.name, FRAME_TIMEOUT_S)
        self.broken()

    def _stop_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def broken(self) -> None:
        """The client broke the protocol: end its connection, answering nothing more."""
        self._buf.clear()
        self.close()
