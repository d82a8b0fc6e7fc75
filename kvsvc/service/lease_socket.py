"""The same-host carrier of lease calls: LeaseChannel's messages on a Unix socket.

A lease message on the gRPC LeaseChannel stream costs P ~0.3 ms of CPU in gRPC's own
machinery and a D→P round trip ~0.4 ms on a small host; the same message framed on a
Unix socket costs a tenth of that. A P server without TLS offers one (its path in the
HandshakeResponse); a D server on the same host connects and sends the LeaseChannel's
requests there. Answers are made by the very code that answers the stream.

Framing: a 4-byte little-endian length, then a serialized LeaseChannelRequest (D to P)
or LeaseChannelResponse (P to D). Who may connect: the socket lives in a directory of
mode 0700, so only this server's user (and root); under TLS no socket is offered, as
lease calls must then carry the caller's certificate. A frame that is too big, does not
parse or has too many calls ends its connection (only kvsvc's own D servers speak this;
D opens a new connection or falls back to the stream), and never touches a lease.
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
from collections.abc import Callable, Sequence

from google.protobuf.message import DecodeError

from kvsvc.client.lease_channel import SOCKET_DIR_PREFIX, SOCKET_NAME, frame, split_frames
from kvsvc.errors import KvsvcError
from kvsvc.limits import MAX_LEASE_CALLS, check_count
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# Connections at once (a D server keeps one per P server it reads from).
MAX_CONNECTIONS = 1024
# A frame, once its first byte came, must be whole within this long (a connection may be
# idle between frames for as long as D keeps it).
FRAME_TIMEOUT_S = 10.0

Answer = Callable[[pb.LeaseCall, Sequence[str]], pb.LeaseAnswer]

# A server killed without stopping (SIGKILL, OOM) leaves its socket's directory behind;
# the next server to start removes such directories: kvsvc's name and mode, this user's,
# older than this (a server starting meanwhile binds within milliseconds), holding nothing
# but a socket nobody listens on.
STALE_AFTER_S = 60.0
_DIR_NAME = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"[0-9a-f]{8}-[a-z0-9_]{8}")


def remove_stale_dirs(root: str | None = None, min_age_s: float = STALE_AFTER_S) -> int:
    """Remove the socket directories of servers that are gone (see STALE_AFTER_S); how many went."""
    root = root or tempfile.gettempdir()
    removed = 0
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
            if any(n != SOCKET_NAME for n in names):
                continue
            if names and _answers(os.path.join(entry.path, SOCKET_NAME)):
                continue  # a live server's
            shutil.rmtree(entry.path)
            removed += 1
        except OSError:
            continue  # raced with its owner or another cleaner: leave it
    if removed:
        log.info("removed %d lease-socket directories of servers that are gone from %s", removed, root)
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


class LeaseSocket:
    """A Unix socket server answering lease calls with answer(call, caller_names=())."""

    def __init__(self, answer: Answer, max_message_bytes: int, epoch: int) -> None:
        self._answer = answer
        self._max_bytes = max_message_bytes
        self._epoch = epoch
        self._dir = ""
        self.path = ""
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self.connections_served = 0  # connections accepted so far (for tests and inspection)

    async def start(self) -> None:
        """Make the private directory and listen in it (OSError when the temp dir cannot hold it)."""
        remove_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{self._epoch & 0xFFFFFFFF:08x}-")  # mode 0700
        self.path = os.path.join(self._dir, SOCKET_NAME)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(self._connection, path=self.path)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    async def close(self) -> None:
        """Stop accepting, end every connection (D's calls on them are retried or fall back
        to the stream, which answers SHUTTING_DOWN), remove the socket."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _connection(self) -> _Connection:
        return _Connection(self)


class _Connection(asyncio.Protocol):
    """One D server's connection. Frames are answered as they arrive, inside the callback
    that received them: a lease call costs no task, no coroutine and no extra loop turn
    (the reader-and-writer coroutines it used to be cost P more than the lease table's
    own work). A D that stops reading pauses only its own connection's reading."""

    def __init__(self, owner: LeaseSocket) -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._frame_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        owner = self._owner
        if len(owner._conns) >= MAX_CONNECTIONS:
            log.warning("lease socket: %d connections open, refusing another", len(owner._conns))
            transport.close()
            return
        owner._conns.add(self)
        owner.connections_served += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._conns.discard(self)
        self._stop_timer()

    def close(self) -> None:
        self._stop_timer()
        if self._transport is not None:
            self._transport.close()

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()  # answer no more until D took what it was sent

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        bodies, too_big = split_frames(buf, self._owner._max_bytes)
        answers: list[bytes] = []
        for body in bodies:
            msg = _parse(body)
            if msg is None:
                return self._broken()
            answers.append(frame(pb.LeaseChannelResponse(answers=[self._owner._answer(c, ()) for c in msg.calls])))
        if too_big:
            log.warning("lease socket: a %d-byte frame is over the %d-byte limit; closing", too_big,
                        self._owner._max_bytes)
            return self._broken()
        if answers and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(answers))
        # A frame, once its first byte came, must be whole within FRAME_TIMEOUT_S.
        if answers or not buf:
            self._stop_timer()
        if buf and self._frame_timer is None:
            self._frame_timer = asyncio.get_running_loop().call_later(FRAME_TIMEOUT_S, self._frame_overdue)

    def eof_received(self) -> bool:
        return False  # D closed its side: close ours

    def _frame_overdue(self) -> None:
        self._frame_timer = None
        log.warning("lease socket: a frame not whole after %.0f s; closing", FRAME_TIMEOUT_S)
        self._broken()

    def _stop_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _broken(self) -> None:
        """The peer broke the protocol: end its connection, answering nothing more."""
        self._buf.clear()
        self.close()


def _parse(body: bytes) -> pb.LeaseChannelRequest | None:
    """The request in a frame; None when it is not a valid LeaseChannelRequest."""
    try:
        msg = pb.LeaseChannelRequest.FromString(body)
        check_count(msg.calls, "calls", MAX_LEASE_CALLS)
    except (DecodeError, KvsvcError) as e:
        log.warning("lease socket: a frame that is not a valid LeaseChannelRequest (%s); closing", e)
        return None
    return msg
