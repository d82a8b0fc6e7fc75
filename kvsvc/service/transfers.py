"""D-side transfers by request id: one job per id, joined by retries, settled state on request.

A Transfer runs as a job the server owns, not inside the RPC that asked for it, so that:
- a retry of the same request (same D request id, same params, same local blocks) joins
  the running job, or gets the finished job's outcome, instead of reading twice;
- a caller that cancels or loses its connection can still learn when the request's
  local blocks are settled (WaitTransfer): a job is settled once no READ of it can still
  write into those blocks;
- asking about an id that was never seen fences it, so a Transfer that was still on its
  way in cannot start writing after the engine was told the blocks are settled.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

HISTORY_S = 300.0
"""How long a finished job's outcome (or a fence) is kept for retries and WaitTransfer."""
HISTORY_MAX = 100_000
"""Most finished jobs and fences kept; the oldest go first."""


class JobState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FENCED = "fenced"


@dataclass
class Job:
    """One D-side transfer. fingerprint identifies what was asked (params + local blocks)."""

    request_id: str
    fingerprint: bytes
    task: asyncio.Task[pb.TransferResponse] | None
    state: JobState = JobState.RUNNING
    waiters: int = 0
    finished_at: float = 0.0
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def outcome(self) -> pb.WaitTransferResponse:
        if self.state is JobState.RUNNING:
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_RUNNING)
        if self.state is JobState.FENCED or self.task is None:
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_UNKNOWN)
        if self.state is JobState.SUCCEEDED:
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_SUCCEEDED, result=self.task.result())
        err = None if self.task.cancelled() else self.task.exception()
        failure = next((d for d in getattr(err, "details", ()) if isinstance(d, pb.TransferFailure)),
                       pb.TransferFailure())
        reason = err.reason if isinstance(err, KvsvcError) else "CANCELLED" if err is None else "INTERNAL"
        return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_FAILED, failure=failure, error_reason=reason)


def fingerprint(req: pb.TransferRequest) -> bytes:
    """What makes two Transfer requests the same request: params and local blocks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(req.params.SerializeToString(deterministic=True))
    for g in req.local_block_ids_per_group:
        h.update(g.SerializeToString(deterministic=True))
        h.update(b"|")
    return h.digest()


class TransferJobs:
    """The jobs of one D server: running ones, and a bounded history of finished ones."""

    def __init__(self) -> None:
        self._running: dict[str, Job] = {}
        self._done: OrderedDict[str, Job] = OrderedDict()

    def start_or_join(self, request_id: str, print_: bytes,
                      run: Callable[[], Coroutine[Any, Any, pb.TransferResponse]]) -> Job:
        """The job for request_id: the running or finished one if it asked the same, else a new one.

        The same id asking something else is TRANSFER_EXISTS while its transfer runs or after
        it succeeded; after it failed, a new transfer starts.
        """
        self._prune()
        job = self._running.get(request_id) or self._done.get(request_id)
        if job is not None:
            if job.state is JobState.FENCED:
                raise FailedPrecondition("TRANSFER_FENCED", f"request {request_id!r} was reported settled by "
                                         "WaitTransfer before this Transfer arrived; use a new request id",
                                         {"request_id": request_id})
            if job.fingerprint == print_:
                return job
            if job.state is not JobState.FAILED:
                raise KvsvcError("TRANSFER_EXISTS", f"request {request_id!r} already has a transfer with other "
                                 "params or blocks", {"request_id": request_id}, code=ErrorCode.ALREADY_EXISTS)
            # Failed and settled: the engine may try the request again with new params (for
            # example re-prefilled elsewhere after PEER_UNAVAILABLE); the old record goes.
            self._done.pop(request_id, None)
        job = Job(request_id, print_, None)
        job.task = asyncio.get_running_loop().create_task(run(), name=f"kvsvc-transfer-{request_id[:32]}")
        self._running[request_id] = job
        job.task.add_done_callback(lambda _t: self._finished(job))
        return job

    def _finished(self, job: Job) -> None:
        assert job.task is not None
        ok = not job.task.cancelled() and job.task.exception() is None
        job.state = JobState.SUCCEEDED if ok else JobState.FAILED
        job.finished_at = time.monotonic()
        job.settled.set()
        self._running.pop(job.request_id, None)
        self._done[job.request_id] = job

    async def wait(self, request_id: str, wait_s: float) -> pb.WaitTransferResponse:
        """The job's state, waiting up to wait_s for it to settle; fences unknown ids."""
        self._prune()
        job = self._running.get(request_id) or self._done.get(request_id)
        if job is None:
            fence = Job(request_id, b"", None, JobState.FENCED, finished_at=time.monotonic())
            fence.settled.set()
            self._done[request_id] = fence
            return fence.outcome()
        if not job.settled.is_set() and wait_s > 0:
            try:
                await asyncio.wait_for(asyncio.shield(job.settled.wait()), wait_s)
            except TimeoutError:
                pass
        return job.outcome()

    def find(self, request_id: str) -> Job | None:
        """The running or remembered job of request_id."""
        return self._running.get(request_id) or self._done.get(request_id)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def remembered(self) -> int:
        return len(self._done)

    async def close(self, timeout_s: float = 15.0) -> None:
        """Cancel running jobs and wait (at most timeout_s) until they settled (their READs drained)."""
        tasks = [j.task for j in self._running.values() if j.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                log.error("%d transfers did not settle before shutdown", len(pending))

    def _prune(self) -> None:
        horizon = time.monotonic() - HISTORY_S
        while self._done:
            job = next(iter(self._done.values()))
            if job.finished_at > horizon and len(self._done) <= HISTORY_MAX:
                break
            self._done.popitem(last=False)
