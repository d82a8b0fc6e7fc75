"""ClaimLease and Notify over one LeaseChannel stream to a P server.

A unary gRPC call costs a whole call setup on both sides (about 0.7 ms a round trip on a
small host); a message on an open stream costs about 0.3 ms. A D server makes two or
three lease calls per transfer to the same P server, so it keeps one stream per P server
and matches answers to calls by call_id. The answers and errors are those of the unary
calls, so callers cannot tell the difference -- except that a stream that breaks before
a call was answered leaves its outcome unknown, exactly like a lost unary call
(UNAVAILABLE, retried once on a fresh stream: both calls are idempotent). Calls made
while a message is being written go out together in the next one.

A P server without LeaseChannel (UNIMPLEMENTED) is spoken to with unary calls from then on.

A P server on the same host may offer a Unix socket for the same messages (its path in
the handshake answer; kvsvc/framing.py has the framing): the stream then runs there, at a
tenth of the cost. On either carrier the stream is a client/multiplex.py Multiplexer, as a
TransferStream is. A socket that cannot be connected to (another host, another user, a P
server gone) is given up for good and the gRPC stream used instead; a socket connection
that breaks is like a broken stream (the call is retried once).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvsvc.client.client import AsyncClient
from kvsvc.client.errors import error_from_status
from kvsvc.client.multiplex import DEFAULT_MAX_MESSAGE_BYTES, Multiplexer, StreamEnded, StreamKind
from kvsvc.client.socket_call import SocketCall
from kvsvc.errors import Cancelled, DeadlineExceeded, Internal, KvsvcError, Unimplemented, Unreachable
from kvsvc.framing import LEASE_SOCKET_NAME, socket_path_of
from kvsvc.limits import MAX_LEASE_CALLS
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb


class LeaseCalls(Protocol):
    """What a D server asks of a P server's leases, on whatever carries it: a LeaseChannel
    (a stream, on gRPC or a same-host socket), or an AsyncClient's unary calls."""

    async def claim_lease(self, request: pb.ClaimLeaseRequest, *, timeout_s: float | None = None,
                          traceparent: str = "") -> pb.ClaimLeaseResponse: ...

    async def notify(self, request: pb.NotifyRequest, *, timeout_s: float | None = None,
                     traceparent: str = "") -> pb.NotifyResponse: ...


log = logging.getLogger(__name__)

_METHOD = "/kvsvc.v1.KvTransferService/LeaseChannel"


def usable_socket_path(path: str) -> str:
    """path when it is a lease socket a peer may name (absolute, kvsvc's shape), else ""."""
    return socket_path_of(path, LEASE_SOCKET_NAME)


def _answers(resp: pb.LeaseChannelResponse) -> Iterator[tuple[int, pb.LeaseAnswer | KvsvcError]]:
    for answer in resp.answers:
        error = answer.WhichOneof("result") == "error_status"
        yield answer.call_id, _decode_error(answer.error_status) if error else answer


LEASE_STREAM: StreamKind[int, pb.LeaseCall, pb.LeaseAnswer] = StreamKind(
    "the LeaseChannel", lambda calls: pb.LeaseChannelRequest(calls=calls), _answers,
    lambda resp: _decode_error(resp.stream_error) if resp.stream_error else None, status_after_failed_write=False,
    key=lambda call: call.call_id)


def lease_stream(call: Any, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Multiplexer[int, pb.LeaseCall, pb.LeaseAnswer]:
    """One LeaseChannel (a gRPC call or a lease socket connection) shared by many calls."""
    return Multiplexer(call, LEASE_STREAM, MAX_LEASE_CALLS, max_bytes)


def _decode_error(data: bytes) -> KvsvcError:
    try:
        return error_from_status(status_pb2.Status.FromString(data))
    except DecodeError:
        return Internal(Reason.INTERNAL, f"the P server answered an unreadable error ({len(data)} bytes)")


class LeaseChannel:
    """claim_lease / notify like AsyncClient's, over one stream to client's server."""

    def __init__(self, client: AsyncClient, socket_path: str = "") -> None:
        self._client = client
        self._socket_path = usable_socket_path(socket_path)  # P's lease socket ("" or given up: gRPC)
        self._connecting = asyncio.Lock()
        self._stream: Multiplexer[int, pb.LeaseCall, pb.LeaseAnswer] | None = None
        self._ids = itertools.count(1)
        self._unary = False
        self._closed = False

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def carrier(self) -> str:
        """Where the next stream opens: "socket" (P's lease socket) or "grpc"."""
        return "socket" if self._socket_path else "grpc"

    @property
    def is_open(self) -> bool:
        """Whether a stream is open now (it opens on the first call, and again after a break)."""
        return self._stream is not None and not self._stream.ended

    async def claim_lease(self, request: pb.ClaimLeaseRequest, *, timeout_s: float | None = None,
                          traceparent: str = "") -> pb.ClaimLeaseResponse:
        return await self._one("claim", request, self._client.claim_lease, timeout_s,  # type: ignore[no-any-return]
                                traceparent)

    async def notify(self, request: pb.NotifyRequest, *, timeout_s: float | None = None,
                     traceparent: str = "") -> pb.NotifyResponse:
        return await self._one("notify", request, self._client.notify, timeout_s,  # type: ignore[no-any-return]
                               traceparent)

    async def _one(self, kind: str, request: Any, unary: Callable[..., Any], timeout_s: float | None,
                   traceparent: str) -> Any:
        """One call on the stream (kind: the LeaseCall field), or unary where the server has no stream."""
        if not self._unary:
            answer = await self._call(
                lambda cid: pb.LeaseCall(call_id=cid, traceparent=traceparent, **{kind: request}), timeout_s)
            if answer is not None:
                return getattr(answer, kind)
        return await unary(request, timeout_s=timeout_s, traceparent=traceparent)

    async def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            await self._stream.close()
            self._stream = None

    async def _call(self, make: Callable[[int], pb.LeaseCall], timeout_s: float | None) -> pb.LeaseAnswer | None:
        """The answer; None when the server has no LeaseChannel (the caller goes unary)."""
        timeout = timeout_s or self._client.options.timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        breaks = 0  # a broken stream is retried once (both calls are idempotent)
        while True:
            call = make(next(self._ids))
            stream: Multiplexer[int, pb.LeaseCall, pb.LeaseAnswer] | None = None
            fut: asyncio.Future[pb.LeaseAnswer] | None = None
            number: int | None = None  # the call's number on the stream, once queued
            try:
                # The deadline covers the write too; a write stuck past it ends the stream
                # (below), and the next call opens a new one.
                async with asyncio.timeout_at(deadline):
                    stream = self._stream if self.is_open else await self._open()
                    assert stream is not None
                    fut = stream.expect(call.call_id)
                    number = stream.queued
                    await stream.send(call)
                    return await fut
            except TimeoutError:
                if stream is not None and number is not None and stream.unwritten(number):
                    # This call was not even written within its timeout: P stopped reading. The
                    # next call opens a fresh stream instead of queueing behind it.
                    stream.end(Unreachable(f"a write on the LeaseChannel to {self.address} took over {timeout:.3f} s"))
                raise DeadlineExceeded(Reason.DEADLINE_EXCEEDED, f"no answer on the LeaseChannel to {self.address} "
                                       f"within {timeout:.3f} s") from None
            except StreamEnded as e:
                ended = e.error
                if isinstance(ended, Unimplemented):
                    log.info("%s has no LeaseChannel: lease calls go unary", self.address)
                    self._unary = True
                    return None
                if ended is not None and ended.reason == Reason.SOCKET_FULL and self._socket_path:
                    # Refused before anything was read: the same call again, on the gRPC stream.
                    log.warning("lease socket of %s is full: lease calls go over gRPC", self.address)
                    self._socket_path = ""
                    continue
                if ended is not None and not isinstance(ended, (Unreachable, Cancelled)):
                    raise ended from None  # the server's own answer for the stream (SHUTTING_DOWN, ...)
                breaks += 1
                if breaks == 2 or self._closed or loop.time() >= deadline:
                    raise Unreachable(f"the LeaseChannel to {self.address} broke before the "
                                      f"answer: {ended or 'closed'}") from None
            finally:
                if stream is not None and fut is not None:
                    stream.forget(call.call_id, fut)

    async def _open(self) -> Multiplexer[int, pb.LeaseCall, pb.LeaseAnswer]:
        async with self._connecting:  # one stream at a time, however many callers found none
            if self._stream is not None and not self._stream.ended:
                return self._stream
            if self._closed:
                raise Unreachable(f"the LeaseChannel to {self.address} is closed")
            call: Any = None
            if self._socket_path:
                try:
                    max_bytes = self._client.options.max_message_bytes
                    _, call = await asyncio.get_running_loop().create_unix_connection(
                        lambda: SocketCall(max_bytes, pb.LeaseChannelResponse.FromString, "the lease socket"),
                        self._socket_path)
                except OSError as e:
                    log.info("lease socket %s of %s unusable (%s): lease calls go over gRPC", self._socket_path,
                             self.address, e)
                    self._socket_path = ""
            if call is None:
                # No deadline: the stream lives as long as the peer; each call has its own.
                call = self._client.channel.stream_stream(
                    _METHOD, request_serializer=pb.LeaseChannelRequest.SerializeToString,
                    response_deserializer=pb.LeaseChannelResponse.FromString)()
            self._stream = lease_stream(call, self._client.options.max_message_bytes)
            return self._stream
