"""The same-host carrier of lease calls: LeaseChannel's messages on a Unix socket.

A lease message on the gRPC LeaseChannel stream costs P ~0.3 ms of CPU in gRPC's own
machinery and a D→P round trip ~0.4 ms on a small host; the same message framed on a
Unix socket costs a tenth of that. A P server without TLS offers one (its path in the
HandshakeResponse); a D server on the same host connects and sends the LeaseChannel's
requests there. Answers are made by the very code that answers the stream.

Framing (kvsvc/framing.py): a 4-byte little-endian length, then a serialized
LeaseChannelRequest (D to P) or LeaseChannelResponse (P to D). Who may connect: the
socket lives in a directory of mode 0700, so only this server's user (and root); under
TLS no socket is offered, as lease calls must then carry the caller's certificate. A
frame that is too big, does not parse or has too many calls ends its connection (only
kvsvc's own D servers speak this; D opens a new connection or falls back to the
stream), and never touches a lease. service/local_socket.py has the socket's upkeep.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from kvsvc.errors import KvsvcError
from kvsvc.framing import LEASE_SOCKET_NAME, frame
from kvsvc.limits import MAX_LEASE_CALLS, check_count
from kvsvc.service.errors import to_status
from kvsvc.service.lease_calls import LaterAnswers, LeaseCallAnswers
from kvsvc.service.local_socket import FramedConnection, LocalSocket, remove_stale_dirs
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["LeaseSocket", "remove_stale_dirs"]


class LeaseSocket(LocalSocket):
    """A Unix socket server answering lease calls as the gRPC LeaseChannel does (answers, the
    servicer's: service/lease_calls.py)."""

    def __init__(self, answers: LeaseCallAnswers, max_message_bytes: int, epoch: int) -> None:
        super().__init__(LEASE_SOCKET_NAME, _Connection, max_message_bytes, epoch)
        self.answers = answers


class _Connection(FramedConnection):
    """One D server's connection. Frames are answered as they arrive, inside the callback
    that received them: a lease call costs no task, no coroutine and no extra loop turn
    (the reader-and-writer coroutines it used to be cost P more than the lease table's
    own work). A D that stops reading pauses only its own connection's reading. A claim
    that waits for its lease is answered in a frame of its own when it ends."""

    owner: LeaseSocket
    _later: LaterAnswers | None = None

    def frames_received(self, bodies: list[bytes]) -> None:
        answer = self.owner.answers.answer
        out: list[bytes] = []
        for body in bodies:
            msg = _parse(body)
            if msg is None:
                return self.broken()
            answers = []
            for call in msg.calls:
                a = answer(call, ())
                if isinstance(a, pb.LeaseAnswer):
                    answers.append(a)
                else:
                    if self._later is None:
                        self._later = LaterAnswers(self._send_later)
                    self._later.start(a)
            if answers:
                out.append(frame(pb.LeaseChannelResponse(answers=answers)))
        if out:
            self._write(b"".join(out))

    def _send_later(self, answer: pb.LeaseAnswer) -> None:
        self._write(frame(pb.LeaseChannelResponse(answers=[answer])))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._later is not None:
            self._later.cancel()

    def refusal(self, error: KvsvcError) -> bytes:
        return frame(pb.LeaseChannelResponse(stream_error=to_status(error).SerializeToString()))


def _parse(body: bytes) -> pb.LeaseChannelRequest | None:
    """The request in a frame; None when it is not a valid LeaseChannelRequest."""
    try:
        msg = pb.LeaseChannelRequest.FromString(body)
        check_count(msg.calls, "calls", MAX_LEASE_CALLS)
    except (DecodeError, KvsvcError) as e:
        log.warning("lease socket: a frame that is not a valid LeaseChannelRequest (%s); closing", e)
        return None
    return msg
