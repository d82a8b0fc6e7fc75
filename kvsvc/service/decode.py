"""The D side's Transfer jobs: one per request id, joined by retries, each pairing with its
P servers and running a TransferRun (transfer_run.py) over them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from kvsvc.client.leases import abort_published
from kvsvc.codec import bad_field
from kvsvc.config import Role
from kvsvc.errors import KvsvcError, PermissionDenied
from kvsvc.limits import (
    MAX_ADDRESS_BYTES,
    MAX_WAIT_MS,
    check_block_lists,
    check_id,
    check_num_tokens,
    check_tp_size,
    clip,
    too_big,
)
from kvsvc.logs import REQUEST_ID
from kvsvc.reasons import Reason
from kvsvc.service.legs import Leg, p_servers, servers_needed, settled
from kvsvc.service.node import Node
from kvsvc.service.peer_transports import PeerTransports
from kvsvc.service.peers import PeerCache, Peers, peer_client_options
from kvsvc.service.stacks import await_chain
from kvsvc.service.tracing import Clock, mark_error, record_span, server_span
from kvsvc.service.transfer_run import MIN_DEADLINE_MARGIN_S, TransferRun
from kvsvc.service.transfers import Job, TransferJobs, fingerprint
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# A Transfer's job stops at the caller's deadline less a margin (a fifth of the time,
# within these bounds), so the answer -- with TransferFailure, after the READs settled --
# reaches the caller in time. A tenth (150 ms of a 1.5 s deadline) was once too little on
# a loaded 2-core host: the answer came after the caller's deadline.
DEADLINE_MARGIN = 0.2
MAX_DEADLINE_MARGIN_S = 1.0
# A Transfer called without a deadline still ends.
NO_DEADLINE_S = 600.0
# Refusals of a pair that say the lease is not this P's to free: made by another run of
# it (LEASE_EXPIRED after a restart) or held by another engine (UNKNOWN_ENGINE).
NOT_OURS_TO_FREE = (Reason.LEASE_EXPIRED, Reason.UNKNOWN_ENGINE)


def _record(recorded: list[Callable[[], None]]) -> None:
    for record in recorded:
        record()


def _cancel_unwanted(job: Job) -> None:
    if job.waiters == 0 and job.task is not None and not job.task.done():
        job.task.cancel()


def _log_overdue(request_id: str, task: asyncio.Task[Any]) -> None:
    if not task.done():
        log.error("transfer %s is past its deadline and still running: %s", request_id, await_chain(task))


def _deadline(time_remaining_s: float | None) -> float:
    """The job's own deadline (monotonic): the caller's, less a margin to answer in."""
    if time_remaining_s is None:
        return time.monotonic() + NO_DEADLINE_S
    margin = min(MAX_DEADLINE_MARGIN_S, max(MIN_DEADLINE_MARGIN_S, DEADLINE_MARGIN * time_remaining_s))
    return time.monotonic() + max(0.0, time_remaining_s - margin)


def _check_request(req: pb.TransferRequest) -> None:
    """Field checks and limits, before any work or any record is made."""
    p = req.params
    if not req.request_id:
        raise bad_field("request_id", "must be set (the D-side request id; WaitTransfer asks by it)", Reason.MISSING_FIELD)
    check_id(req.request_id, "request_id")
    for name in ("remote_address", "remote_request_id"):
        if not getattr(p, name):
            raise bad_field(f"params.{name}", "must be set (copy TransferParams from PublishBlocks)", Reason.MISSING_FIELD)
    if p.remote_epoch == 0:
        raise bad_field("params.remote_epoch", "must be set (copy TransferParams from PublishBlocks)", Reason.MISSING_FIELD)
    check_id(p.remote_address, "params.remote_address", MAX_ADDRESS_BYTES)
    for name in ("remote_engine_id", "remote_request_id", "lease_token"):
        check_id(getattr(p, name), f"params.{name}")
    check_tp_size(p.remote_tp_size, "params.remote_tp_size")
    check_tp_size(p.remote_dcp_size, "params.remote_dcp_size")
    check_num_tokens(p.remote_num_tokens, "params.remote_num_tokens")
    check_block_lists([g.block_ids for g in p.remote_block_ids_per_group], "params.remote_block_ids_per_group")
    check_block_lists([g.block_ids for g in req.local_block_ids_per_group], "local_block_ids_per_group")
    check_num_tokens(req.local_prefix_tokens, "local_prefix_tokens")
    if req.local_prefix_tokens and not p.progressive:
        raise bad_field("local_prefix_tokens", "is for progressive params only: a plain transfer names the tail "
                        "of the request's blocks it reads, and the lists are paired at their ends",
                        Reason.INVALID_FIELD)


class Decoder:
    """Runs Transfer RPCs for the D ranks this server hosts, as jobs (see transfers.py)."""

    def __init__(self, node: Node, peers: Peers | None = None) -> None:
        self.node = node
        self.peers: Peers = peers if peers is not None else PeerCache(node)
        self.transports = PeerTransports(node, lambda: node.data.read_paths() if node.data is not None else [],
                                         node.metrics.peer_transport)
        self.jobs = TransferJobs()
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self.jobs.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.peers.close()

    async def transfer(self, req: pb.TransferRequest, time_remaining_s: float | None,
                       trace_ctx: Context | None = None) -> pb.TransferResponse:
        """Start (or join) the job for req.request_id and await it.

        A caller that goes away cancels the job unless another caller (a retry) still
        waits for it; the job then settles its READs and tells P to let go.
        """
        job = self.join(req, time_remaining_s, trace_ctx)
        try:
            if not job.finished.is_set():
                await job.finished.wait()  # a cancel here is this caller's, never the job's
        finally:
            self.leave(job)
        return self.outcome(job)

    def join(self, req: pb.TransferRequest, time_remaining_s: float | None,
             trace_ctx: Context | None = None) -> Job:
        """Check req and start (or join) its job, counted as one more caller waiting for it
        until leave(); raises what the request's checks raise."""
        node = self.node
        node.require_role(Role.DECODE, "Transfer")
        node.require_data_plane("Transfer")
        _check_request(req)
        allowed = node.config.allowed_peers
        if allowed and req.params.remote_engine_id not in allowed:
            raise PermissionDenied(Reason.PEER_NOT_ALLOWED, f"this server may not read from engine "
                                   f"{clip(req.params.remote_engine_id, 64)!r} (not in allowed_peers)",
                                   {"engine_id": req.params.remote_engine_id})
        deadline = _deadline(time_remaining_s)
        job = self.jobs.start_or_join(req.request_id, fingerprint(req), lambda: self._measured(req, deadline, trace_ctx))
        job.waiters += 1
        return job

    @staticmethod
    def leave(job: Job) -> None:
        """A caller stops waiting for job; the last one to go cancels it if it still runs (it
        then settles its READs and tells P to let go).

        The cancel is sent after the job's first step (queued when it was made): a task
        cancelled before it ran never runs its handlers, and P's lease would wait out its
        TTL. A retry that joins meanwhile keeps the job.
        """
        job.waiters -= 1
        if job.waiters == 0:
            asyncio.get_running_loop().call_soon(_cancel_unwanted, job)

    @staticmethod
    def outcome(job: Job) -> pb.TransferResponse:
        """A finished job's response, or the error it ended with (a cancelled one: a retry joined
        a transfer whose first caller gave up, said typed and settled)."""
        return job.answer()

    async def given_up(self, request_id: str) -> bool:
        """After a caller gave up waiting for request_id's transfer: wait until nothing of it
        writes into its local blocks any more and return True, or return False at once when
        another caller (a retry) still waits for it and it goes on."""
        job = self.jobs.find(request_id)
        if job is None or job.settled.is_set():
            return True
        if job.waiters > 0:
            return False
        await asyncio.shield(job.settled.wait())
        return True

    async def wait(self, req: pb.WaitTransferRequest) -> pb.WaitTransferResponse:
        node = self.node
        node.require_role(Role.DECODE, "WaitTransfer")
        if not req.request_id:
            raise bad_field("request_id", "must be set (the D-side request id given to Transfer)", Reason.MISSING_FIELD)
        check_id(req.request_id, "request_id")
        if req.wait_ms > MAX_WAIT_MS:
            raise too_big("wait_ms", req.wait_ms, MAX_WAIT_MS, "ms")
        return await self.jobs.wait(req.request_id, req.wait_ms / 1000)

    async def _measured(self, req: pb.TransferRequest, deadline: float,
                        trace_ctx: Context | None = None) -> pb.TransferResponse:
        """One job, counted once (retries that join it are not) by outcome and reason, and
        traced as one span (under the caller's trace when it sent one).

        Its metrics are recorded once the job ended, after the callbacks that answer it:
        one transfer at a time, its caller then waits for none of that.
        """
        started = time.perf_counter()
        peer_engine = req.params.remote_engine_id
        REQUEST_ID.set(req.request_id)  # this job's own task: every log line of it names the request
        task = asyncio.current_task()
        assert task is not None
        recorded: list[Callable[[], None]] = []  # metrics to record once the job was answered
        # A job still running past its own deadline (plus the answer margin) is stuck on
        # something unbounded: say where, once.
        overdue = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()) + MAX_DEADLINE_MARGIN_S, _log_overdue, req.request_id, task)
        with server_span("kvsvc.Transfer", trace_ctx or Context(), **{
                "kvsvc.request_id": req.request_id, "kvsvc.remote_request_id": req.params.remote_request_id,
                "kvsvc.peer_engine": peer_engine}) as span:
            try:
                resp = await self._run(req, deadline, recorded)
            except BaseException as e:
                reason = e.reason if isinstance(e, KvsvcError) else (
                    Reason.CANCELLED if isinstance(e, asyncio.CancelledError) else Reason.INTERNAL)
                self.node.metrics.transfer_failed(peer_engine, reason)
                mark_error(span, e if isinstance(e, KvsvcError) else KvsvcError(reason, str(e)))
                raise
            finally:
                overdue.cancel()
                task.add_done_callback(lambda _t: _record(recorded))
            span.set_attribute("kvsvc.bytes", resp.total_bytes)
        recorded.append(functools.partial(
            self.node.metrics.transfer_ok, peer_engine, time.perf_counter() - started, resp.total_bytes,
            sum(r.num_descriptors for r in resp.ranks), max((r.duration_us for r in resp.ranks), default=0) / 1e6))
        if resp.after_final_us:
            recorded.append(functools.partial(self.node.metrics.progressive_after_final, resp.after_final_us / 1e6))
        return resp

    async def _run(self, req: pb.TransferRequest, deadline: float,
                   recorded: list[Callable[[], None]]) -> pb.TransferResponse:
        async with contextlib.AsyncExitStack() as stack:
            with self._lease_back_if_unposted(req.params):
                legs = await self._pair(req.params, stack)
                job = self.jobs.find(req.request_id)  # this one's, running this coroutine
                run = TransferRun(self.node, req, legs, deadline, recorded, self._keep,
                                  quarantine=job.quarantine if job is not None else lambda _events, _nbytes: None)
                reads = run.plan()
            resp = await run.execute(reads)
            recorded.append(functools.partial(self.transports.observe, [leg.peer for leg in legs]))
            return resp

    @contextlib.contextmanager
    def _lease_back_if_unposted(self, p: pb.TransferParams) -> Iterator[None]:
        """Until the first READ is posted, a failure (a refused pair, a plan that cannot be
        read, the caller gone) gives P its lease back at once instead of at its TTL --
        unless the lease is not this P's to free (another run of it, another engine).
        From the first post on TransferRun's failure path tells P itself."""
        try:
            yield
        except BaseException as e:
            if not (isinstance(e, KvsvcError) and e.reason in NOT_OURS_TO_FREE):
                self._spawn(self._abort_unpaired(p))
            raise

    async def _pair(self, p: pb.TransferParams, stack: contextlib.AsyncExitStack) -> list[Leg]:
        """The P servers this server's ranks read from, each handshaken and held for the
        transfer (by stack), with the D ranks it serves."""
        node = self.node
        needed = servers_needed(p_servers(p), node.hosted_ranks, node.config.tp_size, p.remote_tp_size,
                                node.layout.dcp_size, p.remote_dcp_size or 1)
        clock, peer_started = Clock(), time.perf_counter()
        entered = await settled([stack.enter_async_context(
            self.peers.use(s.address, p.remote_engine_id, s.epoch)) for s, _ in needed])
        record_span(trace.get_current_span(), clock, "peer", peer_started, time.perf_counter(),
                    **{"kvsvc.p_servers": len(needed)})
        failed = [e for e in entered if isinstance(e, BaseException)]
        if failed:
            # One that leaves the lease to free (a P unreachable, refusing) is raised before
            # one that does not, so the guard gives the others their leases back.
            raise next((e for e in failed if not (isinstance(e, KvsvcError) and e.reason in NOT_OURS_TO_FREE)),
                       failed[0])
        return [Leg(peer, d_ranks) for peer, (_, d_ranks) in zip(entered, needed, strict=True)]  # type: ignore[arg-type]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._keep(asyncio.get_running_loop().create_task(coro))

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a background task until it ends (close() waits for them)."""
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)  # type: ignore[arg-type]

    async def abandon(self, p: pb.TransferParams) -> dict[str, str]:
        """ABORTED (with the lease token) to every P server of a request this engine will not
        read: their leases would otherwise wait out the TTL. Over the handshaken channels,
        a fresh one only to a P server never read from. Returns each server's answer (a
        LeaseState name, or the error reason)."""
        opts = dataclasses.replace(peer_client_options(self.node, p.remote_engine_id), timeout_s=2.0, retries=0)
        handshaken = {peer.address: peer.client for peer in self.peers.listing()}
        return await abort_published(p, engine_id=self.node.config.engine_id, options=opts, channels=handshaken)

    async def _abort_unpaired(self, p: pb.TransferParams) -> None:
        """Best effort, for a request we could not pair with or plan."""
        answers = await self.abandon(p)
        for address, answer in answers.items():
            if not answer.startswith("LEASE_STATE_"):
                log.warning("could not tell %s that %s was refused: %s", address, p.remote_request_id, answer)
