"""The same-host carrier of an engine's transfers: TransferStream's messages on a Unix socket.

At one transfer at a time, a gRPC TransferStream message pair costs the D server ~0.2 ms
of CPU in gRPC's own machinery and the engine as much again -- a third of a 1-block
transfer's time on a small host. A D server without TLS offers its engine a Unix socket
(GetInfoResponse.transfer_socket) carrying the same messages framed
(kvsvc/framing.py); the engine's TransferChannel uses it when it can connect, the gRPC
stream when not.

Each connection is one TransferStream: a TransferStreamSession (service/transfer_stream.py)
runs its transfers, with the same checks, jobs, answers and limits. What differs is the
carrier:
- frames are taken inside the callback that read them (no task, no extra turn per
  message); the first answer of a loop turn is written at once, the turn's later ones
  together at its end;
- an error that ends the stream (a frame that does not parse or has too many calls,
  shutdown) is sent as TransferStreamResponse.stream_error, then the socket closes;
- a caller that stops reading has its connection's reading paused once its unsent
  answers pass the transport's high-water mark: it then starts nothing more, so what it
  can make the server hold is bounded by the transfers it has running;
- a connection that closes gives up its transfers, as a TransferStream that ends does.
Who may connect: this server's user (the socket's directory is mode 0700), who is this
server's engine as far as a server without TLS can tell.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from google.protobuf.message import DecodeError

from kvsvc.errors import InvalidArgument, KvsvcError, Unavailable
from kvsvc.framing import TRANSFER_SOCKET_NAME, frame
from kvsvc.limits import MAX_STREAM_CALLS, clip
from kvsvc.reasons import Reason
from kvsvc.service.decode import Decoder
from kvsvc.service.errors import to_status
from kvsvc.service.local_socket import FramedConnection, LocalSocket
from kvsvc.service.transfer_stream import TransferStreamSession
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


class TransferSocket(LocalSocket):
    """A D server's transfer socket: each connection a TransferStream of its engine."""

    def __init__(self, decoder: Decoder, max_message_bytes: int, epoch: int) -> None:
        super().__init__(TRANSFER_SOCKET_NAME, _Connection, max_message_bytes, epoch)
        self.decoder = decoder
        self.closing = False
        self._drained = asyncio.Event()

    def close_sessions(self) -> None:
        """At shutdown: accept no connection; each stream takes no new transfer, answers its
        running ones and then ends with SHUTTING_DOWN."""
        self.closing = True
        self.stop_accepting()
        for conn in list(self.conns):
            assert isinstance(conn, _Connection)
            conn.session.close()
        self._check_drained()

    async def drain(self, grace_s: float) -> None:
        """close_sessions(), then wait up to grace_s for the streams to end; close the rest."""
        self.close_sessions()
        try:
            if not self._drained.is_set():
                await asyncio.wait_for(self._drained.wait(), grace_s)
        except TimeoutError:
            log.warning("transfer socket: %d streams still running after %.1f s; closing them", len(self.conns),
                        grace_s)
        await self.close()

    def _check_drained(self) -> None:
        if self.closing and not self.conns:
            self._drained.set()


class _SocketSession(TransferStreamSession):
    """A TransferStreamSession whose answers go out on its connection."""

    def __init__(self, conn: _Connection, decoder: Decoder) -> None:
        super().__init__(decoder, None)
        self._conn = conn
        self._batch: list[pb.TransferAnswer] = []
        self._flush_due = False

    def _answer(self, answer: pb.TransferAnswer) -> None:
        if self._flush_due:
            self._batch.append(answer)
        else:
            # The first answer of a loop turn goes out at once (one transfer at a time, its
            # caller waits for nothing else); the turn's later ones together at its end.
            self._flush_due = True
            self._loop.call_soon(self.flush)
            self._conn.send(pb.TransferStreamResponse(answers=[answer]))
        self._changed()

    @property
    def answers_waiting(self) -> int:
        return len(self._batch)

    def flush(self) -> None:
        """The answers of this loop turn, as few frames as the per-message limit allows
        (end() sends what is left before its last frame)."""
        self._flush_due = False
        batch, self._batch = self._batch, []
        for i in range(0, len(batch), MAX_STREAM_CALLS):
            self._conn.send(pb.TransferStreamResponse(answers=batch[i:i + MAX_STREAM_CALLS]))

    def _changed(self) -> None:
        if self.closing and self.idle and not self._flush_due:
            self._conn.end(Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down; open a new TransferStream "
                                       "elsewhere"))
        elif self.closing and self.idle:
            self._loop.call_soon(self._changed)  # after the last answers went out


class _Connection(FramedConnection):
    """One engine's TransferStream on the transfer socket."""

    owner: TransferSocket

    def __init__(self, owner: TransferSocket) -> None:
        super().__init__(owner)
        self.session = _SocketSession(self, owner.decoder)
        self._ended = False
        self._paused = False  # the caller does not take its answers: take no frame of it
        self._unread: collections.deque[bytes] = collections.deque()  # frames read, not yet taken

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.owner.closing and not transport.is_closing():
            self.session.close()  # accepted just before the server closed: SHUTTING_DOWN

    def pause_writing(self) -> None:
        self._paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        self._take()
        if not self._paused:  # (taking may have filled the buffer again)
            super().resume_writing()

    def frames_received(self, bodies: list[bytes]) -> None:
        self._unread.extend(bodies)
        self._take()

    def _take(self) -> None:
        """Take frames until none is left or the caller stops taking answers: what it can
        make this connection hold is then one frame's answers and its running transfers'."""
        while self._unread and not self._paused and not self._ended:
            body = self._unread.popleft()
            try:
                msg = pb.TransferStreamRequest.FromString(body)
            except DecodeError as e:
                return self.end(InvalidArgument(
                    Reason.MALFORMED_REQUEST, f"the request is not a valid kvsvc.v1.TransferStreamRequest ({len(body)} "
                    f"bytes): {clip(str(e), 200)}", {"message_type": "kvsvc.v1.TransferStreamRequest",
                                                     "size": len(body)}))
            try:
                self.session.take(msg)
            except KvsvcError as e:
                return self.end(e)
            if self.session.answers_waiting >= MAX_STREAM_CALLS:
                self.session.flush()  # now, so that a caller who does not read pauses us in time

    def refusal(self, error: KvsvcError) -> bytes:
        return frame(pb.TransferStreamResponse(stream_error=to_status(error).SerializeToString()))

    def send(self, msg: pb.TransferStreamResponse) -> None:
        if not self._ended and self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(msg))

    def end(self, error: KvsvcError) -> None:
        """End the stream with error (said in a last frame) and close the socket."""
        if self._ended:
            return
        if error.reason != Reason.SHUTTING_DOWN:
            log.info("TransferStream on the transfer socket ended: %s", clip(str(error), 300))
        self.session.flush()
        self.send(pb.TransferStreamResponse(stream_error=to_status(error).SerializeToString()))
        self._ended = True
        self.session.abandon()
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._ended = True
        self._unread.clear()
        self.session.abandon()  # the engine is gone: its transfers are given up
        self.owner._check_drained()
