"""Transfer over one TransferStream to a D server: what an engine that runs many uses.

A unary Transfer is a whole gRPC call; on a stream each transfer is a message (the proto
says how the server treats them). TransferChannel.transfer() takes and answers what
AsyncClient.transfer() does -- the same response, the same errors with their details --
so a caller can switch by changing one line:

- the transfer's deadline travels in the message (timeout_ms) and is also kept here: a
  server that does not answer in time gives DEADLINE_EXCEEDED, as a unary call would;
- a caller that is cancelled gives the transfer up on the server too (cancel_request_ids);
- a stream that breaks before an answer leaves that transfer's outcome unknown, like a
  lost unary call: UNAVAILABLE (ask AsyncClient.settled() before reusing the blocks);
  the next transfer opens a fresh stream;
- a second transfer with a request id already waiting on this channel, and every
  transfer to a server without TransferStream (UNIMPLEMENTED), go as unary calls.

A D server on the same host may offer its engine a Unix socket for the same messages
(GetInfoResponse.transfer_socket; kvsvc/framing.py has the framing): the stream then
runs there, at a tenth of gRPC's cost per message. The channel asks GetInfo once, when it
first opens a stream; a socket that cannot be connected to (another host, another user,
a server gone) is asked for again once, then given up for gRPC; a socket connection that
breaks is like a broken stream. On either carrier the stream is a client/multiplex.py
Multiplexer, as a LeaseChannel is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvsvc.client.client import AsyncClient, blocks_proto
from kvsvc.client.errors import error_from_rpc, error_from_status
from kvsvc.client.multiplex import DEFAULT_MAX_MESSAGE_BYTES, Multiplexer, StreamEnded, StreamKind
from kvsvc.client.socket_call import SocketCall
from kvsvc.errors import Cancelled, DeadlineExceeded, Internal, KvsvcError, Unimplemented, Unreachable
from kvsvc.framing import TRANSFER_SOCKET_NAME, socket_path_of
from kvsvc.limits import MAX_STREAM_CALLS
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_METHOD = "/kvsvc.v1.KvTransferService/TransferStream"

# How long a new stream waits for the server's headers before it writes anyway.
HEADERS_WAIT_S = 2.0

# The timeout_ms field holds at most this (~49 days).
_MAX_TIMEOUT_MS = (1 << 32) - 1


def _pack(items: list[pb.TransferCall | str]) -> pb.TransferStreamRequest:
    """Transfers to start and request ids to give up (str), in one message."""
    return pb.TransferStreamRequest(transfers=[c for c in items if not isinstance(c, str)],
                                    cancel_request_ids=[c for c in items if isinstance(c, str)])


def _answers(resp: pb.TransferStreamResponse) -> Iterator[tuple[str, pb.TransferAnswer]]:
    return ((answer.request_id, answer) for answer in resp.answers)  # an error is its answer's to raise


TRANSFER_STREAM: StreamKind[str, pb.TransferCall | str, pb.TransferAnswer] = StreamKind(
    "the TransferStream", _pack, _answers,
    lambda resp: _status_error(resp.stream_error, "the transfer socket's end") if resp.stream_error else None,
    status_after_failed_write=True, key=lambda item: item.request.request_id if isinstance(item, pb.TransferCall) else None)

_Stream = Multiplexer[str, pb.TransferCall | str, pb.TransferAnswer]


def transfer_stream(call: Any, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> _Stream:
    """One TransferStream (a gRPC call or a transfer socket connection) shared by many transfers."""
    return Multiplexer(call, TRANSFER_STREAM, MAX_STREAM_CALLS, max_bytes)


class TransferChannel:
    """transfer() like AsyncClient's, over one TransferStream to client's server."""

    def __init__(self, client: AsyncClient, carrier: str = "auto") -> None:
        if carrier not in ("auto", "grpc"):
            raise ValueError(f"carrier must be 'auto' or 'grpc', not {carrier!r}")
        self._client = client
        self._opening = asyncio.Lock()
        self._stream: _Stream | None = None
        self._unary = False
        self._closed = False
        # The server's transfer socket: None until GetInfo was asked, "" when there is none
        # (or it cannot be used from here, or the carrier is gRPC, or TLS is on).
        self._socket_path: str | None = None if carrier == "auto" and client.options.credentials() is None else ""
        self.streams_opened = 0  # streams opened so far (a broken one is replaced on the next transfer)

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def carrier(self) -> str:
        """What the open stream runs on: "socket" or "grpc" ("unary" once transfers go as
        calls; "" before the first stream)."""
        if self._unary:
            return "unary"
        if self._stream is None:
            return ""
        return "socket" if isinstance(self._stream.call, SocketCall) else "grpc"

    @property
    def is_open(self) -> bool:
        """Whether a stream is open now (it opens on the first transfer, and again after a break)."""
        return self._stream is not None and not self._stream.ended

    async def transfer(
        self, request_id: str, params: pb.TransferParams, local_block_ids_per_group: Sequence[Sequence[int]],
        *, timeout_s: float | None = None, traceparent: str = "",
    ) -> pb.TransferResponse:
        """As AsyncClient.transfer (timeout_s: this transfer's deadline, the client's default if None)."""
        req = pb.TransferRequest(request_id=request_id, params=params,
                                 local_block_ids_per_group=blocks_proto(local_block_ids_per_group))
        return await self.transfer_request(req, timeout_s=timeout_s, traceparent=traceparent)

    async def transfer_request(self, req: pb.TransferRequest, *, timeout_s: float | None = None,
                               traceparent: str = "") -> pb.TransferResponse:
        timeout = timeout_s or self._client.options.timeout_s
        try:
            stream = None if self._unary or self._closed else await self._open()
        except Unimplemented:  # other refusals (NOT_AN_ENGINE, SHUTTING_DOWN, ...) go to the caller
            log.info("%s has no TransferStream: transfers go unary", self.address)
            self._unary, stream = True, None
        if stream is None or req.request_id in stream.pending:
            return await self._client.transfer_request(req, timeout_s=timeout, traceparent=traceparent)
        fut = stream.expect(req.request_id)
        call = pb.TransferCall(request=req, timeout_ms=min(_MAX_TIMEOUT_MS, max(1, int(timeout * 1000))),
                               traceparent=traceparent)
        answered = False
        number = stream.queued  # this call's number on the stream
        try:
            async with asyncio.timeout(timeout):
                await stream.send(call)
                answer = await fut
            answered = True
        except TimeoutError:
            if stream.unwritten(number):
                # Not even written within the transfer's timeout: the server stopped reading;
                # the next transfer opens a fresh stream instead of queueing behind it.
                stream.end(Unreachable(f"a write on the TransferStream to {self.address} took over {timeout:.3f} s"))
            raise DeadlineExceeded(Reason.DEADLINE_EXCEEDED, f"no answer from {self.address} for transfer "
                                   f"{req.request_id!r} within {timeout:.3f} s") from None
        except StreamEnded as e:
            answered = True  # nothing left to give up on that stream
            if isinstance(e.error, Unimplemented):
                log.info("%s has no TransferStream: transfers go unary", self.address)
                self._unary = True
                return await self._client.transfer_request(req, timeout_s=timeout, traceparent=traceparent)
            if e.error is not None and e.error.reason == Reason.SOCKET_FULL and self._socket_path:
                # The socket refused the connection before reading anything: nothing started
                # there, so the same transfer goes over the gRPC stream (and later ones too).
                log.warning("transfer socket of %s is full: transfers go over gRPC", self.address)
                self._socket_path = ""
                return await self.transfer_request(req, timeout_s=timeout, traceparent=traceparent)
            if e.error is not None and not isinstance(e.error, (Unreachable, Cancelled)):
                raise e.error from None  # the server's own end of the stream (SHUTTING_DOWN, NOT_AN_ENGINE, ...)
            raise Unreachable(f"the TransferStream to {self.address} broke before the answer "
                              f"to {req.request_id!r}: {e.error or 'closed'}") from None
        finally:
            stream.forget(req.request_id, fut)
            if not answered and not stream.ended:
                # Cancelled or timed out here: give it up on the server too (as a unary caller
                # going away would), without waiting for that message to go out.
                self._spawn_cancel(stream, req.request_id)
        if answer.WhichOneof("result") == "response":
            return answer.response
        raise _error_of(answer)

    def _spawn_cancel(self, stream: _Stream, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(stream.send(request_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a broken stream gave it up anyway

    async def _open(self) -> _Stream:
        if self._stream is not None and not self._stream.ended:
            return self._stream
        async with self._opening:  # one stream at a time, however many callers found none
            if self._stream is None or self._stream.ended:
                stream: _Stream | None = await self._open_socket()
                if stream is None:
                    # No deadline: the stream lives as long as the channel; each transfer has its own.
                    call = self._client.channel.stream_stream(
                        _METHOD, request_serializer=pb.TransferStreamRequest.SerializeToString,
                        response_deserializer=pb.TransferStreamResponse.FromString)()
                    self.streams_opened += 1  # opened, even if the server then refuses it
                    await _accepted(call)
                    stream = transfer_stream(call, self._client.options.max_message_bytes)
                else:
                    self.streams_opened += 1
                self._stream = stream
            return self._stream

    async def _open_socket(self) -> _Stream | None:
        """A stream on the server's transfer socket, or None (then gRPC): the path GetInfo
        gave, asked again once if it no longer connects (the server restarted)."""
        for _attempt in range(2):
            if self._socket_path == "":
                return None
            asked = self._socket_path is None
            if self._socket_path is None:
                try:
                    info = await self._client.get_info()
                except KvsvcError as e:
                    log.info("GetInfo of %s failed (%s): transfers go over the gRPC stream", self.address, e)
                    self._socket_path = ""
                    return None
                self._socket_path = socket_path_of(info.transfer_socket, TRANSFER_SOCKET_NAME)
                if not self._socket_path:
                    return None
            call = await self._connect(self._socket_path)
            if call is not None:
                return transfer_stream(call, self._client.options.max_message_bytes)
            self._socket_path = "" if asked else None  # a path just given is given up; an older one asked again
        return None

    async def _connect(self, path: str) -> SocketCall | None:
        max_bytes = self._client.options.max_message_bytes
        try:
            _, call = await asyncio.get_running_loop().create_unix_connection(
                lambda: SocketCall(max_bytes, pb.TransferStreamResponse.FromString, "the transfer socket"), path)
        except OSError as e:
            log.info("transfer socket %s of %s unusable (%s)", path, self.address, e)
            return None
        return call  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Close the stream: transfers still waiting on it are given up (on the server too,
        which gives up every transfer of a stream that ends); later transfers go as unary calls."""
        self._closed = True
        if self._stream is not None:
            await self._stream.close()
            self._stream = None


async def _accepted(call: Any) -> None:
    """Return once the server took the stream (its headers came); raise its refusal.

    A refused stream ends with its headers (trailers only): reading that before the first
    write keeps the server's reason (NOT_AN_ENGINE, SHUTTING_DOWN, UNIMPLEMENTED), which a
    write into the ended call would turn into gRPC's own INTERNAL. A server that sends its
    headers only with its first answer (an older kvsvc) is not waited for past HEADERS_WAIT_S.
    """
    headers = asyncio.ensure_future(call.initial_metadata())
    await asyncio.wait([headers], timeout=HEADERS_WAIT_S)
    if not headers.done():
        headers.add_done_callback(lambda f: f.cancelled() or f.exception())
        return
    if headers.exception() is None and not call.done():
        return
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        raise error_from_rpc(e) from None
    raise Unreachable("the TransferStream ended as it opened")


def _error_of(answer: pb.TransferAnswer) -> KvsvcError:
    return _status_error(answer.error_status, "error")


def _status_error(data: bytes, what: str) -> KvsvcError:
    try:
        return error_from_status(status_pb2.Status.FromString(data))
    except DecodeError:
        return Internal(Reason.INTERNAL, f"the D server answered an unreadable {what} ({len(data)} bytes)")
