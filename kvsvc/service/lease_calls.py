"""Answering the calls of a LeaseChannel (on gRPC or the lease socket): at once, or later.

Every call is answered as it arrives, in the message it came in, except a claim that asks
to wait (ClaimLeaseRequest.wait_ms) for a lease the engine has not made yet: its answer
comes in a later message, once the lease was made or refused or the wait is over
(leases/arrivals.py), while the calls behind it are answered as before. Answers carry
their call_id, so a client matches them whatever their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from kvsvc.codec import bad_field
from kvsvc.errors import KvsvcError, lease_not_yet_made
from kvsvc.limits import clip
from kvsvc.logs import REQUEST_ID
from kvsvc.reasons import Reason
from kvsvc.service import prefill
from kvsvc.service.errors import to_status
from kvsvc.service.node import Node
from kvsvc.service.tracing import context_from_traceparent, server_span
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

Later = Coroutine[Any, Any, pb.LeaseAnswer]


@contextlib.contextmanager
def traced(call: str, request: Any, ctx: Context | None) -> Iterator[None]:
    """A lease call this P server answers: its log lines name the P-side request, and it is a
    span in the caller's trace when the caller sent one."""
    token = REQUEST_ID.set(getattr(request, "request_id", ""))
    try:
        if ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid:
            yield
            return
        with server_span(f"kvsvc.{call}", ctx, **{"kvsvc.request_id": getattr(request, "request_id", ""),
                                                 "kvsvc.peer_engine": getattr(request, "engine_id", "")}):
            yield
    finally:
        REQUEST_ID.reset(token)


class LeaseCallAnswers:
    """One P server's answers to lease calls, for every LeaseChannel carrier."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def answer(self, call: pb.LeaseCall, names: Sequence[str]) -> pb.LeaseAnswer | Later:
        """The call's answer now, or (a claim waiting for its lease) a coroutine that makes it
        later; the carrier runs that in a task of its own and sends what it returns."""
        which = call.WhichOneof("call")
        body = getattr(call, which) if which else None
        with traced(which or "none", body, self._context(call)):
            try:
                if which == "claim" and call.claim.want_content:  # its digests may still be taken
                    return self._later(call, names)
                if which == "claim":
                    return pb.LeaseAnswer(call_id=call.call_id, claim=prefill.claim(self.node, call.claim, names))
                if which == "notify":
                    return pb.LeaseAnswer(call_id=call.call_id, notify=prefill.notify(self.node, call.notify, names))
                raise bad_field("calls.call", "set claim or notify", Reason.MISSING_FIELD)
            except Exception as e:
                if which == "claim" and call.claim.wait_ms and lease_not_yet_made(e):
                    return self._later(call, names)
                return _error(call, which, e)

    async def _later(self, call: pb.LeaseCall, names: Sequence[str]) -> pb.LeaseAnswer:
        with traced("claim", call.claim, self._context(call)):
            try:
                return pb.LeaseAnswer(call_id=call.call_id,
                                      claim=await prefill.claim_when_made(self.node, call.claim, names))
            except Exception as e:
                return _error(call, "claim", e)

    @staticmethod
    def _context(call: pb.LeaseCall) -> Context | None:
        return context_from_traceparent(call.traceparent) if call.traceparent else None


def _error(call: pb.LeaseCall, which: str | None, e: Exception) -> pb.LeaseAnswer:
    """A failed call's answer: its error, and the stream goes on."""
    if isinstance(e, KvsvcError):
        log.info("LeaseChannel %s failed: %s", which, clip(str(e), 300))
        err = e
    else:  # a bug: answer INTERNAL for this call, keep the stream
        log.exception("LeaseChannel %s crashed", which, exc_info=e)
        err = KvsvcError(Reason.INTERNAL, f"internal error in LeaseChannel {which}: {type(e).__name__}: {e}")
    return pb.LeaseAnswer(call_id=call.call_id, error_status=to_status(err).SerializeToString())


class LaterAnswers:
    """The tasks of one stream's waiting claims; each hands its answer to send()."""

    def __init__(self, send: Callable[[pb.LeaseAnswer], None]) -> None:
        self._send = send
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, later: Later) -> None:
        task = asyncio.get_running_loop().create_task(self._run(later), name="kvsvc waiting claim")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, later: Later) -> None:
        self._send(await later)

    async def drain(self) -> None:
        """Until every waiting claim was answered (a client that half-closed its side still
        hears them: grpcurl sends its calls, closes, and reads)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel(self) -> None:
        """The stream ended: its waiting claims stop waiting (nobody is there to answer)."""
        for task in list(self._tasks):
            task.cancel()
