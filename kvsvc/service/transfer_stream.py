"""TransferStream on D: an engine's Transfers as messages on one long-lived stream.

A unary Transfer pays a whole gRPC call on both sides; on a small host that was ~0.4 ms of
the D server's CPU per transfer and ~0.45 ms of its round trip, more than the rest of a
1-block transfer's own work. On a stream each transfer is a message. Every transfer still
joins its Decoder job as Decoder.transfer does (Decoder.join / leave / outcome) -- the
same checks, job, retries and errors as the unary call -- so the stream adds no rule of
its own beyond the few below:

- a request id may run only once at a time on one stream (answers are matched by it);
- at most MAX_STREAM_TRANSFERS run on one stream (the rest are answered
  RESOURCE_EXHAUSTED, the stream goes on), and a caller that sends but does not read
  finds its stream ended (RESOURCE_EXHAUSTED) once MAX_UNREAD_ANSWERS answers wait for it:
  what a stream holds is bounded whatever its caller does;
- a message that does not parse or has too many calls ends the stream (nothing past it can
  be trusted), which gives up the stream's transfers like a caller going away;
- a transfer given up by cancel_request_ids is answered CANCELLED once settled (see the
  proto); one given up because the stream ended is answered to nobody;
- at shutdown a stream takes no new transfers (SHUTTING_DOWN answers), answers the running
  ones and then ends with SHUTTING_DOWN.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from kvsvc.errors import ErrorCode, KvsvcError, Unavailable
from kvsvc.limits import MAX_STREAM_CALLS, MAX_STREAM_TRANSFERS, check_count, clip
from kvsvc.reasons import Reason
from kvsvc.service.decode import Decoder
from kvsvc.service.errors import Malformed, to_status
from kvsvc.service.tracing import context_from_traceparent
from kvsvc.service.transfers import Job
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# Answers waiting for a caller that does not read them, past which its stream ends.
MAX_UNREAD_ANSWERS = 2 * MAX_STREAM_TRANSFERS


def _error_answer(request_id: str, err: KvsvcError) -> pb.TransferAnswer:
    return pb.TransferAnswer(request_id=request_id, error_status=to_status(err).SerializeToString())


class TransferStreamSession:
    """One open TransferStream: its running transfers and the answers not yet sent.

    A transfer here is its Decoder job, joined as one more caller (Decoder.join) and
    answered from the job's done callback: no task of its own, no await per transfer.
    """

    def __init__(self, decoder: Decoder, time_remaining_s: float | None) -> None:
        self._decoder = decoder
        self._loop = asyncio.get_running_loop()
        # The stream's own deadline (monotonic, loop time), if its caller set one.
        self._deadline = None if time_remaining_s is None else self._loop.time() + time_remaining_s
        self._running: dict[str, Job] = {}
        self._giving_up: set[asyncio.Task[None]] = set()  # transfers given up, answered once settled
        self._answers: list[pb.TransferAnswer] = []
        self._overflow: KvsvcError | None = None
        self._reader: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.closing = False

    def close(self) -> None:
        """Take no new transfers; end once the running ones are answered."""
        self.closing = True
        self._changed()

    @property
    def idle(self) -> bool:
        """Nothing of the stream runs or waits to be answered as given up."""
        return not self._running and not self._giving_up

    def take(self, msg: pb.TransferStreamRequest) -> None:
        """One message from the caller: its transfers started, its cancels given up.
        INVALID_ARGUMENT when it holds too many of either (the stream is then to end)."""
        check_count(msg.transfers, "transfers", MAX_STREAM_CALLS)
        check_count(msg.cancel_request_ids, "cancel_request_ids", MAX_STREAM_CALLS)
        for call in msg.transfers:
            self._start(call)
        for request_id in msg.cancel_request_ids:
            self._give_up(request_id)

    def abandon(self) -> list[asyncio.Task[None]]:
        """The caller is gone: its transfers are given up as a unary caller going away gives
        a transfer up (nobody is answered); returns the give-up answers cancelled here."""
        running, self._running = list(self._running.values()), {}
        for job in running:
            self._decoder.leave(job)
        giving_up = list(self._giving_up)
        for task in giving_up:
            task.cancel()
        return giving_up

    async def answers(self, requests: AsyncIterator[Any]) -> AsyncIterator[pb.TransferStreamResponse]:
        """The stream's answers, until its caller stopped sending and every transfer was
        answered (or until close()). Raises the KvsvcError of a message that cannot be
        trusted, after giving up every transfer of the stream."""
        reader = self._reader = self._loop.create_task(self._read(requests), name="kvsvc-transfer-stream")
        reader.add_done_callback(lambda _t: self._wake.set())
        try:
            while True:
                if self._overflow is not None:
                    raise self._overflow
                if not self._answers:
                    if reader.done() or self.closing:
                        if self.idle:
                            break
                        if reader.done() and reader.exception() is not None:
                            break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch, self._answers = self._answers[:MAX_STREAM_CALLS], self._answers[MAX_STREAM_CALLS:]
                yield pb.TransferStreamResponse(answers=batch)
            if reader.done() and not reader.cancelled():
                error = reader.exception()
                if error is not None:
                    raise error
        finally:
            reader.cancel()
            giving_up = self.abandon()
            await asyncio.gather(reader, *giving_up, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        async for msg in requests:
            if isinstance(msg, Malformed):
                raise msg.error()
            self.take(msg)

    def _start(self, call: pb.TransferCall) -> None:
        request_id = call.request.request_id
        if self.closing:
            return self._answer(_error_answer(request_id, Unavailable(
                Reason.SHUTTING_DOWN, "this server is shutting down and starts no transfer")))
        if request_id in self._running:
            return self._answer(_error_answer(request_id, KvsvcError(
                Reason.TRANSFER_ON_STREAM, f"request {clip(request_id, 64)!r} is already running on this stream; "
                "wait for its answer", {"request_id": request_id}, code=ErrorCode.ALREADY_EXISTS)))
        if len(self._running) >= MAX_STREAM_TRANSFERS:
            return self._answer(_error_answer(request_id, KvsvcError(
                Reason.TOO_MANY_TRANSFERS, f"{len(self._running)} transfers already run on this stream (the limit)",
                {"limit": MAX_STREAM_TRANSFERS}, code=ErrorCode.RESOURCE_EXHAUSTED)))
        try:
            trace_ctx = context_from_traceparent(call.traceparent) if call.traceparent else None
            job = self._decoder.join(call.request, self._time_remaining(call), trace_ctx)
        except KvsvcError as e:
            log.info("TransferStream transfer %s failed: %s", clip(request_id, 64), clip(str(e), 300))
            return self._answer(_error_answer(request_id, e))
        self._running[request_id] = job
        job.on_done(lambda done: self._finished(request_id, done))

    def _time_remaining(self, call: pb.TransferCall) -> float | None:
        """The transfer's own deadline or the stream's, whichever is sooner (None: neither)."""
        own = call.timeout_ms / 1000 if call.timeout_ms else None
        if self._deadline is None:
            return own
        stream = max(0.0, self._deadline - self._loop.time())
        return stream if own is None else min(own, stream)

    def _finished(self, request_id: str, job: Job) -> None:
        """The job ended while this stream still waited for it: its answer."""
        if self._running.get(request_id) is not job:
            return  # given up meanwhile (answered elsewhere, or the stream ended)
        del self._running[request_id]
        self._decoder.leave(job)
        try:
            answer = pb.TransferAnswer(request_id=request_id, response=self._decoder.outcome(job))
        except KvsvcError as e:
            log.info("TransferStream transfer %s failed: %s", clip(request_id, 64), clip(str(e), 300))
            answer = _error_answer(request_id, e)
        except Exception as e:  # a bug: answer INTERNAL for this transfer, keep the stream
            log.error("TransferStream transfer %s crashed", clip(request_id, 64), exc_info=e)
            answer = _error_answer(request_id, KvsvcError(
                Reason.INTERNAL, f"internal error in TransferStream: {type(e).__name__}: {e}"))
        self._answer(answer)

    def _give_up(self, request_id: str) -> None:
        """cancel_request_ids: stop waiting for the transfer; answer CANCELLED once it settled."""
        job = self._running.pop(request_id, None)
        if job is None:
            return  # not running on this stream (answered already, or never started here)
        self._decoder.leave(job)
        task = self._loop.create_task(self._answer_given_up(request_id))
        self._giving_up.add(task)
        task.add_done_callback(self._given_up_done)

    def _given_up_done(self, task: asyncio.Task[None]) -> None:
        self._giving_up.discard(task)
        self._changed()

    async def _answer_given_up(self, request_id: str) -> None:
        settled = await self._decoder.given_up(request_id)
        self._answer(_error_answer(request_id, KvsvcError(
            Reason.TRANSFER_CANCELLED, f"request {clip(request_id, 64)!r} was given up on this stream" + (
                "" if settled else "; another caller still waits for it (WaitTransfer tells when it settled)"),
            {"request_id": request_id}, code=ErrorCode.CANCELLED,
            details=[pb.TransferFailure()] if settled else [])))

    def _changed(self) -> None:
        """Something that may end the stream happened (closing, a give-up answered): look."""
        self._wake.set()

    # What a gRPC stream does with an answer (the transfer socket sends it its own way).
    def _answer(self, answer: pb.TransferAnswer) -> None:
        if self._overflow is not None:
            return  # the stream is ending: its caller gets no more answers
        if len(self._answers) >= MAX_UNREAD_ANSWERS:
            # The caller sends but does not read (the answer being written waits on its flow
            # control): take nothing more from it, and end the stream once it moves again.
            self._overflow = KvsvcError(
                Reason.ANSWERS_UNREAD, f"{len(self._answers)} answers wait for this stream's caller, who does not read "
                "them; the stream ends", {"limit": MAX_UNREAD_ANSWERS}, code=ErrorCode.RESOURCE_EXHAUSTED)
            self._answers.clear()
            if self._reader is not None:
                self._reader.cancel()
            self._wake.set()
            return
        self._answers.append(answer)
        self._wake.set()
