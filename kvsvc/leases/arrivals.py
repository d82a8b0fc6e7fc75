"""Claims that wait on P for a lease its engine has not made yet.

An engine may hand out params before its servers lease the blocks (lease_pending: vLLM's
scheduler answers the request in the step its workers publish, or the next). A D that
claims first used to ask again every few ms: ~100 claims and ~100 P log lines for one
waiter, and 1,500 waiters took bystanders' lease calls from ~2 ms to ~200 ms at the
median. Now such a claim says how long it will wait (ClaimLeaseRequest.wait_ms) and P
holds it on an event of its own, set by the publish (or the refusal) of that request id:
one call, no polling, nothing spent while it waits.

Waiters are bounded per D engine and in all, since each holds a future and a call open;
one over either bound is refused at once (RESOURCE_EXHAUSTED, TOO_MANY_WAITING_CLAIMS).
"""

from __future__ import annotations

import asyncio

from kvsvc.errors import ErrorCode, KvsvcError, Unavailable
from kvsvc.reasons import Reason

MAX_WAITING_TOTAL = 16_384  # across engines: engine ids are only names without mTLS


class LeaseArrivals:
    """Futures of claims waiting for request ids to be leased (or refused)."""

    def __init__(self, max_per_engine: int = 4096, max_total: int = MAX_WAITING_TOTAL,
                 waiting_for: str = "leases not made yet") -> None:
        """waiting_for: what the waiters wait for, as a refusal names it."""
        self.max_per_engine = max_per_engine
        self.waiting_for = waiting_for
        self.max_total = max_total
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self._of_engine: dict[str, int] = {}
        self._count = 0
        self._closed = False

    @property
    def waiting(self) -> int:
        """Claims waiting now."""
        return self._count

    def arrived(self, request_id: str) -> None:
        """request_id was leased or refused (or, for commit waiters, committed or released):
        its waiters look again."""
        for fut in self._waiting.pop(request_id, ()):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, request_id: str, engine_id: str, timeout_s: float) -> None:
        """Until request_id arrives or timeout_s passes (the caller then looks for itself)."""
        if self._closed:
            raise Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down")
        held = self._of_engine.get(engine_id, 0)
        if held >= self.max_per_engine or self._count >= self.max_total:
            raise KvsvcError(Reason.TOO_MANY_WAITING_CLAIMS,
                             f"{held} calls of engine {engine_id[:64]!r} ({self._count} in all) wait here for "
                             f"{self.waiting_for}, the most this server holds; ask again later",
                             {"engine_id": engine_id, "waiting": held, "max_per_engine": self.max_per_engine,
                              "waiting_total": self._count, "max_total": self.max_total},
                             code=ErrorCode.RESOURCE_EXHAUSTED)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(request_id, set()).add(fut)
        self._of_engine[engine_id] = held + 1
        self._count += 1
        try:
            await asyncio.wait([fut], timeout=timeout_s)
        finally:
            self._count -= 1
            left = self._of_engine[engine_id] - 1
            if left:
                self._of_engine[engine_id] = left
            else:
                del self._of_engine[engine_id]
            futs = self._waiting.get(request_id)
            if futs is not None:
                futs.discard(fut)
                if not futs:
                    del self._waiting[request_id]
            fut.cancel()
        if self._closed:
            raise Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down")

    def close(self) -> None:
        """At shutdown: every waiter ends (SHUTTING_DOWN) and no new one waits."""
        self._closed = True
        for request_id in list(self._waiting):
            self.arrived(request_id)
