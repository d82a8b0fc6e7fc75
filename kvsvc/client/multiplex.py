"""Many calls as messages on one open stream: what LeaseChannel and TransferChannel share.

A caller registers a future under its call's key, queues the call, and awaits the future;
answers are matched to futures by key as they arrive. The stream runs on one of two
carriers, and the multiplexer hides which:

- a gRPC bidirectional call: a write task, started by whoever queues while none runs,
  writes what is queued, a message at a time; the caller that started it awaits it
  shielded, so no caller's cancellation can cut a message carrying others' calls; a reader
  task takes the answers;
- a framed Unix socket (SocketCall): what is queued in one loop turn goes out as one
  message at its end (a callback: no caller's cancellation can cut a message in two), and
  answers are handed over inside the callback that read them.

A stream ends once, in one step and without awaiting, so no call can join it after: every
call still waiting fails with StreamEnded carrying how it ended (the server's status, a
broken connection as errors.Unreachable, or None when closed here). Whether a call that
was written got through is then unknown, as for a lost unary call; each channel decides
what its callers get (a retry on a fresh stream, or UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from kvsvc.client.errors import error_from_rpc
from kvsvc.client.socket_call import SocketCall
from kvsvc.errors import KvsvcError, Unreachable
from kvsvc.limits import too_big

K = TypeVar("K", bound=Hashable)  # what matches an answer to its call (call_id, request_id)
Item = TypeVar("Item")  # one queued call
Answer = TypeVar("Answer")

# After a failed write, how long the reader may take to bring the server's status (for
# the kinds that wait for it).
STATUS_WAIT_S = 2.0
# A stream's messages are bounded in bytes as well as in calls (ClientOptions.max_message_bytes,
# which the servers' limit matches by default); a message's own framing and each call's
# field tag and length fit in these.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MESSAGE_MARGIN_BYTES = 64 * 1024
CALL_OVERHEAD_BYTES = 16


def _size(item: object) -> int:
    return item.ByteSize() if isinstance(item, Message) else len(str(item))


class StreamEnded(Exception):
    """The stream ended before this call was answered; error says how (None: closed here)."""

    def __init__(self, error: KvsvcError | None, what: str = "the stream") -> None:
        super().__init__(str(error) if error else f"{what} ended")
        self.error = error


@dataclass(frozen=True, slots=True)
class StreamKind(Generic[K, Item, Answer]):
    """What one kind of stream (LeaseChannel, TransferStream) looks like to the multiplexer."""

    what: str  # "the LeaseChannel", "the TransferStream": for errors and task names
    pack: Callable[[list[Item]], Message]  # queued calls (at most a message's worth) -> one message
    answers: Callable[[Any], Iterable[tuple[K, Answer | KvsvcError]]]  # a response -> (key, answer or error)
    stream_error: Callable[[Any], KvsvcError | None]  # a response -> how the server ended the stream, if it did
    # A write into a gRPC call the server already ended fails with gRPC's own error; for a
    # stream refused as it opens (a TransferStream: NOT_AN_ENGINE, SHUTTING_DOWN) the
    # server's status is the better account, so the reader is given a moment to bring it.
    # A kind whose broken calls are retried on a fresh stream (LeaseChannel) ends at once.
    status_after_failed_write: bool
    key: Callable[[Item], K | None] = lambda _item: None  # a queued call's key (None: nobody waits on it)


class Multiplexer(Generic[K, Item, Answer]):
    """One open stream (a gRPC call or a SocketCall) shared by many calls."""

    def __init__(self, call: Any, kind: StreamKind[K, Item, Answer], batch: int,
                 max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.call = call
        self.kind = kind
        self.batch = batch  # the most calls one message carries
        # ...and the most bytes: the carrier's message limit (both ends take 64 MiB by default)
        # less room for the message's own framing.
        self.max_bytes = max(1024, max_bytes - MESSAGE_MARGIN_BYTES)
        self.pending: dict[K, asyncio.Future[Answer]] = {}
        self.queue: list[Item] = []
        self.ended = False
        self._writing = False  # the socket carrier's flush is scheduled
        self._writer: asyncio.Task[None] | None = None  # the gRPC carrier's writes
        self.queued = 0  # calls ever queued: the next one queued is call number `queued`
        self.written = 0  # calls ever written: the first `written` calls are out
        self.reader: asyncio.Task[None] | None = None
        if isinstance(call, SocketCall):
            call.attach(self._deliver, self.end)
        else:
            self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"kvsvc {kind.what}")

    def expect(self, key: K) -> asyncio.Future[Answer]:
        """The future the answer to key will settle (register before sending the call)."""
        if self.ended:
            raise StreamEnded(None, self.kind.what)
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.pending[key] = fut
        return fut

    def forget(self, key: K, fut: asyncio.Future[Answer]) -> None:
        """Its caller stopped waiting (answered, deadline, cancellation): a late answer is dropped."""
        if self.pending.get(key) is fut:
            del self.pending[key]

    async def send(self, item: Item) -> None:
        """Queue one call; returns once it is written or handed to the write in flight.

        On the gRPC carrier the writes run in a task of their own, which this caller awaits
        shielded: a message carries other callers' calls too, and a write cut in the middle
        breaks the stream for every call on it, so a caller that is cancelled (or whose
        deadline passes) stops waiting while the write goes on."""
        if self.ended:
            raise StreamEnded(None, self.kind.what)
        self.queue.append(item)
        self.queued += 1
        if isinstance(self.call, SocketCall):
            if not self._writing:
                self._writing = True
                asyncio.get_running_loop().call_soon(self._flush)
            return
        if self._writer is not None and not self._writer.done():
            return  # the write in flight sends it
        self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name=f"kvsvc {self.kind.what} write")
        await asyncio.shield(self._writer)

    async def _write_queued(self) -> None:
        """The gRPC carrier's writes: every queued call, a message at a time. A failed write
        ends the stream (whether the message left is unknown: its calls' outcomes are unknown,
        as for a lost call); its callers learn that through their futures."""
        try:
            while (out := self._next_message()) is not None:
                msg, n = out
                await self.call.write(msg)
                self.written += n
        except BaseException as e:
            if (self.kind.status_after_failed_write and not isinstance(e, asyncio.CancelledError)
                    and not self.ended and self.reader is not None):
                await asyncio.wait([self.reader], timeout=STATUS_WAIT_S)
            self.end(Unreachable(f"{self.kind.what} write failed: {type(e).__name__}"))

    def unwritten(self, number: int) -> bool:
        """Whether call number `number` (self.queued when it was sent) is not written yet: at
        its caller's deadline, a sign the server stopped reading (flow control) and the
        stream is no use to anyone."""
        return not self.ended and number >= self.written

    def _next_message(self) -> tuple[Message, int] | None:
        """The next message: queued calls, in order, up to `batch` of them and `max_bytes`.
        A call too large for any message fails alone (FIELD_TOO_LARGE) and is never written:
        a message past the carrier's limit would end the stream for every call on it."""
        while not self.ended and self.queue:
            batch: list[Item] = []
            size = 0
            for item in self.queue[:self.batch]:
                n = _size(item) + CALL_OVERHEAD_BYTES
                if batch and size + n > self.max_bytes:
                    break
                batch.append(item)
                size += n
            del self.queue[:len(batch)]
            if size > self.max_bytes:  # one call alone, too large
                self._refuse(batch[0], size)
                self.written += 1
                continue
            return self.kind.pack(batch), len(batch)
        return None

    def _refuse(self, item: Item, size: int) -> None:
        key = self.kind.key(item)
        fut = self.pending.pop(key, None) if key is not None else None
        if fut is not None and not fut.done():
            fut.set_exception(too_big(f"a call on {self.kind.what}", size, self.max_bytes, "bytes"))

    def _flush(self) -> None:
        """The socket's write of what this loop turn queued."""
        self._writing = False
        try:
            if self.queue:
                self.call.check_reading()
            while (out := self._next_message()) is not None:
                msg, n = out
                self.call.write_now(msg)
                self.written += n
        except Exception as e:
            self.end(Unreachable(f"{self.kind.what} socket write failed: {type(e).__name__}: {e}"))

    def _deliver(self, resp: Any) -> None:
        for key, answer in self.kind.answers(resp):
            fut = self.pending.pop(key, None)
            if fut is None or fut.done():
                continue  # its caller gave up (deadline, cancellation)
            if isinstance(answer, KvsvcError):
                fut.set_exception(answer)
            else:
                fut.set_result(answer)
        error = self.kind.stream_error(resp)
        if error is not None:
            self.end(error)

    async def _read(self) -> None:
        error: KvsvcError | None = None
        try:
            async for resp in self.call:
                self._deliver(resp)
        except grpc.aio.AioRpcError as e:
            error = error_from_rpc(e)
        except asyncio.CancelledError:
            error = Unreachable(f"{self.kind.what} was closed")
        finally:
            self.end(error)

    def end(self, error: KvsvcError | None) -> None:
        """In one step, without awaiting: no call can join this stream after it ended."""
        if self.ended:
            return
        self.ended = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(StreamEnded(error, self.kind.what))
        self.pending.clear()
        self.queue.clear()
        self.call.cancel()

    async def close(self) -> None:
        self.end(Unreachable(f"{self.kind.what} was closed"))
        tasks = [t for t in (self.reader, self._writer) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
