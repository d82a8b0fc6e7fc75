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

from google.rpc import status_pb2

from kvsvc.client.errors import error_from_status
from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError
from kvsvc.limits import clip
from kvsvc.reasons import Reason
from kvsvc.service.errors import to_status
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

HISTORY_S = 300.0
"""How long a finished job's record, or a fence, is kept: a Transfer of its id arriving
within this long is answered from it (a retry) or refused (TRANSFER_FENCED), never run."""
HISTORY_MAX = 100_000
"""Most finished jobs kept with their whole outcome; older ones (within HISTORY_S) are
kept as fences: a retry then gets TRANSFER_FENCED instead of the outcome."""
HISTORY_MAX_BYTES = 64 * 1024 * 1024
"""Most bytes the outcomes of finished jobs may take (estimated per record, see _Outcome)."""
FENCES_MAX = 1_000_000
"""Most fences (ids that may not start a Transfer) kept within HISTORY_S. When that many
were made in the last HISTORY_S, new Transfers and fences are refused (RESOURCE_EXHAUSTED,
TRANSFER_HISTORY_FULL) rather than dropping a fence early. About 100 bytes each
(a 64-bit digest of the id and a time), so at most ~100 MiB."""
MAX_ERROR_MESSAGE = 512
"""A failed job's message, as kept for retries and WaitTransfer (characters)."""
RECORD_OVERHEAD_BYTES = 1024
"""What a finished job costs beyond its outcome's bytes (the Job, dict slots)."""
FAILED_RECORD_EXTRA_BYTES = 1536
"""What a failed one costs beyond that: its record's small objects are made among the
failed run's garbage, and keep allocator pages alive. Both figures are set from D's RSS
per kept record, measured by benchmarks/record_memory.py with 1,000-block requests (failed:
~1.9 KiB on average, at most ~2.6 KiB a batch; successful: ~0.5 KiB), so that the byte
bound holds for what the process spends; tests/e2e/test_record_memory.py checks it."""


class JobState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    QUARANTINED = "quarantined"  # failed and answered, but READs of it may still land: not settled


@dataclass(frozen=True, slots=True)
class FailedOutcome:
    """What stays of a failed job: what its answer needs, nothing of the run that failed
    (an exception would keep its traceback, and with it every frame's locals -- plans,
    address arrays, block lists -- alive as long as the record).

    The answer is kept as one serialized google.rpc.Status (reason, message, metadata and
    the TransferFailure, as the caller receives them): one object of a few hundred bytes
    where the fields as Python objects were a dozen small ones, and small long-lived
    objects scattered among a failed run's garbage kept whole allocator pages alive (a
    kept failed record cost ~3 KiB of D's RSS for ~1.5 KiB of objects; benchmarks/record_memory.py).
    """

    status: bytes
    kind: type[KvsvcError] = KvsvcError  # the error's class (DeadlineExceeded, ...), raised again as such
    cancelled: bool = False

    @classmethod
    def of(cls, task: asyncio.Task[Any]) -> FailedOutcome:
        if task.cancelled():
            return cls(b"", cancelled=True)
        err = task.exception()
        failure = next((d for d in getattr(err, "details", ()) if isinstance(d, pb.TransferFailure)),
                       pb.TransferFailure())
        if isinstance(err, KvsvcError):
            kept = KvsvcError(err.reason, clip(err.message, MAX_ERROR_MESSAGE), err.metadata, err.field_violations,
                              code=err.code, details=[failure])
            return cls(to_status(kept).SerializeToString(), type(err))
        kept = KvsvcError(Reason.INTERNAL, clip(f"{type(err).__name__}: {err}", MAX_ERROR_MESSAGE), details=[failure])
        return cls(to_status(kept).SerializeToString())

    def _decoded(self) -> KvsvcError:
        return error_from_status(status_pb2.Status.FromString(self.status))

    @property
    def reason(self) -> str:
        return Reason.CANCELLED if self.cancelled else self._decoded().reason

    @property
    def failure(self) -> pb.TransferFailure:
        """The TransferFailure the answer carries (a fresh message)."""
        if self.cancelled:
            return pb.TransferFailure()
        return next((d for d in self._decoded().details if isinstance(d, pb.TransferFailure)), pb.TransferFailure())

    def error(self, request_id: str) -> KvsvcError:
        """A new exception for this outcome (each answer raises its own: one raised twice would
        collect the tracebacks of both)."""
        if self.cancelled:
            return KvsvcError(Reason.TRANSFER_CANCELLED, f"request {clip(request_id, 64)!r} was cancelled by an earlier "
                              "caller; use a new request id to try again", {"request_id": request_id},
                              code=ErrorCode.CANCELLED, details=[pb.TransferFailure()])
        e = self._decoded()
        if type(e) is self.kind:
            return e
        try:
            return self.kind(e.reason, e.message, e.metadata, e.field_violations, code=e.code, details=e.details)
        except TypeError:  # a subclass with another constructor
            return e

    @property
    def nbytes(self) -> int:
        return len(self.status)


@dataclass(eq=False)
class Job:
    """One D-side transfer. fingerprint identifies what was asked (params + local blocks).

    task runs the transfer; once it ended, the job keeps only its outcome (result or
    failed) and task is None.
    """

    request_id: str
    fingerprint: bytes
    task: asyncio.Task[pb.TransferResponse] | None
    state: JobState = JobState.RUNNING
    waiters: int = 0
    finished_at: float = 0.0
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # no READ of it can write any more
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # answered (settled, or quarantined)
    result: pb.TransferResponse | None = None
    failed: FailedOutcome | None = None
    unsettled: list[asyncio.Event] = field(default_factory=list)  # quarantined READs' settled events
    quarantined_bytes: int = 0  # what those READs were to write into the engine's blocks

    def quarantine(self, settled: list[asyncio.Event], nbytes: int) -> None:
        """READs of this job may still land once it ended: it settles only once they did."""
        self.unsettled.extend(settled)
        self.quarantined_bytes += nbytes

    def outcome(self) -> pb.WaitTransferResponse:
        if self.state is JobState.RUNNING:
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_RUNNING)
        if self.state is JobState.SUCCEEDED:
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_SUCCEEDED, result=self.result)
        assert self.failed is not None
        reason = self.failed.reason
        failure = self.failed.failure
        if self.state is JobState.QUARANTINED:
            failure.quarantined = True
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_QUARANTINED, failure=failure, error_reason=reason)
        failure.quarantined = False  # settled since
        return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_FAILED, failure=failure, error_reason=reason)

    def answer(self) -> pb.TransferResponse:
        """A finished job's response, or (raised) a fresh copy of the error it ended with."""
        assert self.state is not JobState.RUNNING
        if self.failed is not None:
            raise self.failed.error(self.request_id)
        assert self.result is not None
        return self.result

    def on_done(self, callback: Callable[[Job], None]) -> None:
        """callback(job) once the job finished (soon, when it already has)."""
        if self.task is not None:
            self.task.add_done_callback(lambda _t: callback(self))
        else:
            asyncio.get_running_loop().call_soon(callback, self)

    @property
    def nbytes(self) -> int:
        """What this finished record costs, estimated (outcome bytes + fixed overhead)."""
        size = RECORD_OVERHEAD_BYTES + len(self.request_id)
        if self.result is not None:
            size += self.result.ByteSize() * 4  # a parsed message is a few times its wire size
        if self.failed is not None:
            size += self.failed.nbytes * 2 + FAILED_RECORD_EXTRA_BYTES
        return size


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()  # wait() on a set event returns at once, on any loop
    return event


_SET = _set_event()


def _fence_key(request_id: str) -> int:
    """A fence's key: 64 bits of the id's digest, so a fence costs the same for any id."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def fingerprint(req: pb.TransferRequest) -> bytes:
    """What makes two Transfer requests the same request: params and local blocks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(req.params.SerializeToString(deterministic=True))
    for g in req.local_block_ids_per_group:
        h.update(g.SerializeToString(deterministic=True))
        h.update(b"|")
    return h.digest()


class TransferJobs:
    """The jobs of one D server: running ones, a bounded history of finished ones, and fences.

    A finished job is kept with its outcome for HISTORY_S (at most HISTORY_MAX of them and
    HISTORY_MAX_BYTES); pushed out sooner by those bounds, it stays a fence until HISTORY_S
    passed. A fence is an id that may not start a Transfer: a finished job pushed out, or an
    id WaitTransfer was asked about before any Transfer of it came. Fences are never
    dropped before HISTORY_S: when FENCES_MAX are held, what would add one is refused.
    """

    def __init__(self, history_s: float = HISTORY_S, history_max: int = HISTORY_MAX,
                 history_max_bytes: int = HISTORY_MAX_BYTES, fences_max: int = FENCES_MAX) -> None:
        self._running: dict[str, Job] = {}
        self._done: OrderedDict[str, Job] = OrderedDict()
        self._done_bytes = 0
        self._fences: OrderedDict[int, float] = OrderedDict()  # _fence_key -> when made (monotonic)
        self._held: dict[str, Job] = {}  # quarantined jobs, until their READs ended
        self._quarantined: set[asyncio.Task[None]] = set()  # the watches of their READs
        self.history_s, self.history_max = history_s, history_max
        self.history_max_bytes, self.fences_max = history_max_bytes, fences_max

    def start_or_join(self, request_id: str, print_: bytes,
                      run: Callable[[], Coroutine[Any, Any, pb.TransferResponse]]) -> Job:
        """The job for request_id: the running or finished one if it asked the same, else a new one.

        The same id asking something else is TRANSFER_EXISTS while its transfer runs or after
        it succeeded; after it failed, a new transfer starts.
        """
        self._prune()
        job = self.find(request_id)
        if job is None and _fence_key(request_id) in self._fences:
            raise FailedPrecondition(Reason.TRANSFER_FENCED, f"request {clip(request_id, 64)!r} was reported settled by "
                                     "WaitTransfer, or finished long enough ago to be forgotten, before this "
                                     "Transfer arrived; use a new request id", {"request_id": request_id})
        if job is not None:
            if job.fingerprint == print_:
                return job
            if job.state is not JobState.FAILED:
                raise KvsvcError(Reason.TRANSFER_EXISTS, f"request {clip(request_id, 64)!r} already has a transfer with "
                                 "other params or blocks", {"request_id": request_id}, code=ErrorCode.ALREADY_EXISTS)
            # Failed and settled: the engine may try the request again with new params (for
            # example re-prefilled elsewhere after PEER_UNAVAILABLE); the old record goes.
            self._forget(request_id)
        self._require_room("Transfer")
        job = Job(request_id, print_, None)
        job.task = asyncio.get_running_loop().create_task(run(), name=f"kvsvc-transfer-{request_id[:32]}")
        self._running[request_id] = job
        job.task.add_done_callback(lambda _t: self._finished(job))
        return job

    def _finished(self, job: Job) -> None:
        task = job.task
        assert task is not None
        if not task.cancelled() and task.exception() is None:
            job.state, job.result = JobState.SUCCEEDED, task.result()
        else:
            job.state, job.failed = JobState.FAILED, FailedOutcome.of(task)
        job.task = None  # the task holds the exception, and its traceback the run's frames
        job.finished_at = time.monotonic()
        job.finished.set()
        self._running.pop(job.request_id, None)
        unsettled = [e for e in job.unsettled if not e.is_set()]
        if unsettled and job.state is JobState.FAILED:
            # Held apart from the history until settled: never pruned into a fence (a
            # WaitTransfer would then say UNKNOWN, and the engine reuse blocks a READ may hit).
            job.state = JobState.QUARANTINED
            self._held[job.request_id] = job
            watch = asyncio.get_running_loop().create_task(self._settle_later(job, unsettled))
            self._quarantined.add(watch)
            watch.add_done_callback(self._quarantined.discard)
            return
        job.unsettled = []
        job.settled.set()
        self._remember(job)

    def _remember(self, job: Job) -> None:
        # Its events are set for good: share one set event instead (each holds a deque of
        # waiters, ~600 bytes, kept as long as the record).
        job.settled = job.finished = _SET
        self._done[job.request_id] = job
        self._done_bytes += job.nbytes
        self._prune()

    async def _settle_later(self, job: Job, unsettled: list[asyncio.Event]) -> None:
        """A quarantined job settles (FAILED) once every READ it left behind ended."""
        await asyncio.gather(*(e.wait() for e in unsettled))
        log.warning("transfer %s: its quarantined READs ended; settled", clip(job.request_id, 64))
        job.state, job.unsettled = JobState.FAILED, []
        job.finished_at = time.monotonic()
        self._held.pop(job.request_id, None)
        job.settled.set()
        self._remember(job)

    @property
    def quarantined(self) -> int:
        """Jobs answered failed whose READs may still land (their local blocks are not free)."""
        return len(self._held)

    @property
    def quarantined_bytes(self) -> int:
        """The bytes of the engine's blocks those jobs' READs may still write."""
        return sum(job.quarantined_bytes for job in self._held.values())

    async def wait(self, request_id: str, wait_s: float) -> pb.WaitTransferResponse:
        """The job's state, waiting up to wait_s for it to settle; fences unknown ids."""
        self._prune()
        job = self.find(request_id)
        if job is None:
            key = _fence_key(request_id)
            if key not in self._fences:
                self._require_room("WaitTransfer")
                self._fences[key] = time.monotonic()
            return pb.WaitTransferResponse(state=pb.TRANSFER_STATE_UNKNOWN)
        if not job.settled.is_set() and wait_s > 0:
            try:
                await asyncio.wait_for(asyncio.shield(job.settled.wait()), wait_s)
            except TimeoutError:
                pass
        return job.outcome()

    def find(self, request_id: str) -> Job | None:
        """The running, quarantined or remembered job of request_id."""
        return self._running.get(request_id) or self._held.get(request_id) or self._done.get(request_id)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def remembered(self) -> int:
        return len(self._done)

    @property
    def fences(self) -> int:
        return len(self._fences)

    @property
    def remembered_bytes(self) -> int:
        """The estimated bytes of the finished jobs' records."""
        return self._done_bytes

    async def close(self, timeout_s: float = 15.0) -> None:
        """Cancel running jobs and wait (at most timeout_s) until they settled (their READs drained)."""
        for watch in list(self._quarantined):
            watch.cancel()
        tasks = [j.task for j in self._running.values() if j.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                log.error("%d transfers did not settle before shutdown", len(pending))

    def _require_room(self, what: str) -> None:
        """Refuse what could later need a fence when the fences are full of ones not yet due."""
        if len(self._fences) + len(self._done) + len(self._running) < self.fences_max:
            return
        raise KvsvcError(Reason.TRANSFER_HISTORY_FULL, f"{what} refused: {self.fences_max} request ids were seen in the "
                         f"last {self.history_s:.0f} s, the most this server remembers; try again later",
                         {"fences": len(self._fences), "remembered": len(self._done), "running": len(self._running),
                          "max": self.fences_max, "history_s": int(self.history_s)},
                         code=ErrorCode.RESOURCE_EXHAUSTED)

    def _forget(self, request_id: str) -> Job | None:
        job = self._done.pop(request_id, None)
        if job is not None:
            self._done_bytes -= job.nbytes
        return job

    def _prune(self) -> None:
        horizon = time.monotonic() - self.history_s
        while self._fences:
            made = next(iter(self._fences.values()))
            if made > horizon:
                break
            self._fences.popitem(last=False)
        while self._done:
            job = next(iter(self._done.values()))
            due = job.finished_at <= horizon
            if not due and len(self._done) <= self.history_max and self._done_bytes <= self.history_max_bytes:
                break
            self._forget(job.request_id)
            if not due:  # pushed out before its time: the id stays fenced until then
                self._fences[_fence_key(job.request_id)] = job.finished_at
