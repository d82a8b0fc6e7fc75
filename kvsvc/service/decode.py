"""The D side: one Transfer = plan + NIXL READs on every hosted rank + await + claim (consumed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context

from kvsvc.client.leases import abort_published
from kvsvc.codec import bad_field, block_ids_from_proto
from kvsvc.config import Role
from kvsvc.errors import (
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvsvcError,
    PermissionDenied,
    Unavailable,
)
from kvsvc.leases.table import blocks_digest
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
from kvsvc.mapping.planner import RankPlan
from kvsvc.service.legs import (
    ClaimRefused,
    Leg,
    Ownership,
    abort_all,
    claim_all,
    confirm_all,
    heartbeat,
    p_servers,
    servers_needed,
    settled,
)
from kvsvc.service.node import Node
from kvsvc.service.peers import PeerCache, RemoteRank, peer_client_options
from kvsvc.service.stacks import await_chain
from kvsvc.service.tracing import Clock, mark_error, record_phases, record_span, server_span, traceparent
from kvsvc.service.transfers import Job, TransferJobs, fingerprint
from kvsvc.transport.nixl_thread import InFlight, TransferError
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

# A failed transfer cancels its READs and waits for every one to end before it answers
# (D's blocks must not be written after the caller was told they are invalid); past
# this long it says so in the log and keeps waiting.
DRAIN_WARN_S = 10.0

# A Transfer's job stops at the caller's deadline less a margin (a tenth of the time,
# within these bounds), so the answer -- with TransferFailure, after the READs settled --
# reaches the caller in time.
DEADLINE_MARGIN = 0.1
MIN_DEADLINE_MARGIN_S = 0.05
MAX_DEADLINE_MARGIN_S = 1.0
# A Transfer called without a deadline still ends.
NO_DEADLINE_S = 600.0

# How long D goes on telling P that a failed transfer let go (after its answer, when P
# did not answer in time).
ABORT_TIMEOUT_S = 2.0
# How long P's answers are waited for when the READs settled after the answer was due.
LATE_ANSWER_WAIT_S = 0.2

# How a failed READ is reported (NixlDataPlane's post errors and _all_read's).
READ_FAILURES = ("TRANSFER_FAILED", "NIXL_ERROR")

# READs still running this long after they were posted claim the lease before they end
# (see Decoder._transfer); shorter ones claim it and report it consumed in one message.
EARLY_CLAIM_S = 0.01


@dataclass
class Posted:
    rank: int
    flight: InFlight
    nbytes: int
    descriptors: int


def _addresses(node: Node, ranks: dict[int, RemoteRank],
               plan: RankPlan) -> list[tuple[RemoteRank, np.ndarray, np.ndarray, np.ndarray]]:
    """(remote rank, local addresses, remote addresses, lengths) per source rank."""
    local_base = node.region_bases(plan.local_rank)
    out = []
    for reads in plan.reads:
        if not reads.num_descriptors:
            continue
        rr = ranks.get(reads.remote_rank)
        if rr is None:
            raise FailedPrecondition("PEER_RANKS_MISSING", f"prefill rank {reads.remote_rank} was not in the "
                                     "handshake", {"rank": reads.remote_rank})
        out.append((rr, local_base[reads.local_region] + reads.local_offset,
                    rr.bases[reads.remote_region] + reads.remote_offset, reads.length))
    return out


def _parts(rank: int, flights: list[InFlight], length: np.ndarray) -> list[Posted]:
    """A READ posted in parts (copy lanes): the first carries its bytes and descriptors,
    so the answer counts the READ once; each part is waited for and settled."""
    return [Posted(rank, fl, int(length.sum()) if i == 0 else 0, int(length.size) if i == 0 else 0)
            for i, fl in enumerate(flights)]


async def _all_read(posted: list[Posted]) -> None:
    """Until every posted READ completed; TRANSFER_FAILED when one failed."""
    try:
        await asyncio.gather(*(x.flight.result for x in posted))
    except TransferError as e:
        raise Internal("TRANSFER_FAILED", f"a READ failed: {e}") from e


def _check_read(posted: list[Posted]) -> None:
    """For READs that all ended already: TRANSFER_FAILED when one failed (as _all_read says)."""
    for x in posted:
        error = x.flight.result.exception()
        if error is not None:
            raise Internal("TRANSFER_FAILED", f"a READ failed: {error}") from error


async def _settle_post(post: asyncio.Future[list[InFlight]]) -> bool:
    """Wait out a READ being posted (even if cancelled again); True when it was posted."""
    while not post.done():
        try:
            await asyncio.shield(post)
        except asyncio.CancelledError:
            continue
        except Exception:
            return False
    return post.exception() is None


async def _claim_refusal(claimed: asyncio.Future[None], timeout_s: float) -> ClaimRefused | None:
    """P's refusal of the claim, if that is how it ended (waiting up to timeout_s for it)."""
    if not claimed.done():
        await asyncio.wait([claimed], timeout=timeout_s)
    if claimed.done() and not claimed.cancelled() and isinstance(claimed.exception(), ClaimRefused):
        return claimed.exception()  # type: ignore[return-value]
    return None


async def _to_the_end(coro: Coroutine[Any, Any, T]) -> T:
    """coro's result, running it to its end even when the caller is cancelled meanwhile
    (the caller's cancel is then dropped: what it would have stopped is a settlement)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
    return task.result()


def _answer_by(deadline: float) -> float:
    """When a failed transfer's answer is due: its deadline (the caller's less the margin) plus
    half the least margin, the other half left for the answer to reach the caller."""
    return deadline + MIN_DEADLINE_MARGIN_S / 2


def _until(t: float) -> float:
    return max(0.0, t - time.monotonic())


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
        raise bad_field("request_id", "must be set (the D-side request id; WaitTransfer asks by it)", "MISSING_FIELD")
    check_id(req.request_id, "request_id")
    for name in ("remote_address", "remote_request_id"):
        if not getattr(p, name):
            raise bad_field(f"params.{name}", "must be set (copy TransferParams from PublishBlocks)", "MISSING_FIELD")
    if p.remote_epoch == 0:
        raise bad_field("params.remote_epoch", "must be set (copy TransferParams from PublishBlocks)", "MISSING_FIELD")
    check_id(p.remote_address, "params.remote_address", MAX_ADDRESS_BYTES)
    for name in ("remote_engine_id", "remote_request_id", "lease_token"):
        check_id(getattr(p, name), f"params.{name}")
    check_tp_size(p.remote_tp_size, "params.remote_tp_size")
    check_tp_size(p.remote_dcp_size, "params.remote_dcp_size")
    check_num_tokens(p.remote_num_tokens, "params.remote_num_tokens")
    check_block_lists([g.block_ids for g in p.remote_block_ids_per_group], "params.remote_block_ids_per_group")
    check_block_lists([g.block_ids for g in req.local_block_ids_per_group], "local_block_ids_per_group")


class Decoder:
    """Runs Transfer RPCs for the D ranks this server hosts, as jobs (see transfers.py)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.peers = PeerCache(node)
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
            if not job.settled.is_set():
                await job.settled.wait()  # a cancel here is this caller's, never the job's
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
            raise PermissionDenied("PEER_NOT_ALLOWED", f"this server may not read from engine "
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
            raise bad_field("request_id", "must be set (the D-side request id given to Transfer)", "MISSING_FIELD")
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
                    "CANCELLED" if isinstance(e, asyncio.CancelledError) else "INTERNAL")
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
        return resp

    async def _run(self, req: pb.TransferRequest, deadline: float,
                   recorded: list[Callable[[], None]]) -> pb.TransferResponse:
        p, node = req.params, self.node
        named = p_servers(p)
        try:
            needed = servers_needed(named, node.hosted_ranks, node.config.tp_size, p.remote_tp_size,
                                    node.layout.dcp_size, p.remote_dcp_size or 1)
        except FailedPrecondition:
            self._spawn(self._abort_unpaired(p))  # an impossible pair: free P's blocks now
            raise
        async with contextlib.AsyncExitStack() as stack:
            clock, peer_started = Clock(), time.perf_counter()
            try:
                entered = await settled([stack.enter_async_context(
                    self.peers.use(s.address, p.remote_engine_id, s.epoch)) for s, _ in needed])
            except asyncio.CancelledError:
                self._spawn(self._abort_unpaired(p))  # given up before any claim: free P's blocks
                raise
            record_span(trace.get_current_span(), clock, "peer", peer_started, time.perf_counter(),
                        **{"kvsvc.p_servers": len(needed)})
            failed = [e for e in entered if isinstance(e, BaseException)]
            if failed:
                # Could not pair (refused, a NIXL failure, cancelled): free P's blocks now, unless
                # the lease is not this P's to free (another run of it, another engine).
                if not all(isinstance(e, KvsvcError) and e.reason in ("LEASE_EXPIRED", "UNKNOWN_ENGINE")
                           for e in failed):
                    self._spawn(self._abort_unpaired(p))
                raise failed[0]
            legs = [Leg(peer, d_ranks) for peer, (_, d_ranks) in zip(entered, needed, strict=True)]  # type: ignore[arg-type]
            return await self._transfer(req, legs, deadline, recorded)

    async def _transfer(self, req: pb.TransferRequest, legs: list[Leg], deadline: float,
                        recorded: list[Callable[[], None]]) -> pb.TransferResponse:
        node, data, p = self.node, self.node.require_data_plane("Transfer"), req.params
        started = time.perf_counter()
        side = legs[0].peer.side
        for leg in legs:
            if (p.remote_tp_size and p.remote_tp_size != leg.peer.tp_size) or leg.peer.side != side:
                raise InvalidArgument("TP_MISMATCH", f"params say remote TP {p.remote_tp_size} but "
                                      f"{leg.peer.address} runs TP {leg.peer.tp_size} (or another layout)",
                                      {"params_tp_size": p.remote_tp_size, "remote_tp_size": leg.peer.tp_size})
        if (p.remote_dcp_size or 1) != side.layout.dcp_size:
            # The servers to claim at were chosen by the params' DCP size: a wrong one misses ranks.
            self._spawn(self._abort_unpaired(p))
            raise InvalidArgument("DCP_MISMATCH", f"params say remote DCP {p.remote_dcp_size or 1} but the prefill "
                                  f"engine runs DCP {side.layout.dcp_size}",
                                  {"params_dcp_size": p.remote_dcp_size, "remote_dcp_size": side.layout.dcp_size})
        local_ids = block_ids_from_proto(req.local_block_ids_per_group)
        remote_ids = block_ids_from_proto(p.remote_block_ids_per_group)
        ranks = {r: rr for leg in legs for r, rr in leg.peer.ranks.items()}
        try:
            plans = node.plan(side, local_ids, remote_ids, node.hosted_ranks, validated=True,
                              remote_num_tokens=p.remote_num_tokens)
            reads = [(plan.local_rank, a) for plan in plans for a in _addresses(node, ranks, plan)]
        except (InvalidArgument, FailedPrecondition):
            self._spawn(self._abort_unpaired(p))
            raise  # blocks that cannot be read: free P's now, not at TTL
        marks = [("plan", time.perf_counter())]
        span, clock = trace.get_current_span(), Clock()
        own = Ownership(p, node.config.engine_id, node.config.tp_size, secrets.token_hex(16), node.layout.dcp_size,
                        traceparent(span), blocks_digest(remote_ids, p.remote_num_tokens))

        posted: list[Posted] = []
        # Read first, then claim: one lease message per transfer, sent once the READs are
        # done, that claims the lease and reports it consumed at once. P grants it only if
        # the lease was never released since it was published, and P frees blocks only on
        # release, so the grant proves every byte read (docs/RELIABILITY.md, promise 1). A
        # read still running after EARLY_CLAIM_S claims the lease while it runs: the claim
        # extends the lease, heartbeats keep it, a router can no longer abort it, and the
        # final CONSUMED must find the claim still held.
        claimed: asyncio.Future[None] | None = None
        keepers: list[asyncio.Future[None]] = []
        reads_done: asyncio.Future[None] | None = None
        try:
            for t, (rr, la, ra, ln) in reads:
                now = data.read_now(t, rr.agent_name, la, ra, ln, rr.memory_kind, rr.device_id)
                if now is not None:  # a short READ, posted already: nothing to wait for or cancel
                    posted.append(Posted(t, now, int(ln.sum()), int(ln.size)))
                    continue
                post = asyncio.ensure_future(data.read(t, rr.agent_name, la, ra, ln, rr.memory_kind, rr.device_id))
                try:
                    await asyncio.shield(post)
                except asyncio.CancelledError:
                    # Cancelled while the NIXL thread posts: the READ runs anyway, so it must be
                    # known here to be settled before anyone hears the blocks are free.
                    if not post.cancelled() and (post.done() or await _settle_post(post)):
                        posted.extend(_parts(t, post.result(), ln))
                    raise
                posted.extend(_parts(t, post.result(), ln))
            marks.append(("post", time.perf_counter()))
            if all(x.flight.result.done() for x in posted):
                _check_read(posted)  # short READs often end inside their post: nothing to wait for
            else:
                reads_done = asyncio.ensure_future(_all_read(posted))
                try:
                    async with asyncio.timeout(min(EARLY_CLAIM_S, self._left(deadline))):  # not wait_for:
                        await asyncio.shield(reads_done)  # in 3.11 it can swallow a cancel that races the result
                except TimeoutError:
                    claimed = self._claim(legs, own, deadline, span, clock)
                    keepers = [asyncio.ensure_future(heartbeat(leg, own, claimed)) for leg in legs]
                    both = asyncio.gather(claimed, reads_done)
                    try:
                        async with asyncio.timeout(self._left(deadline)):
                            await both
                    except TimeoutError as e:
                        raise DeadlineExceeded("DEADLINE_EXCEEDED", "the reads did not finish before the deadline",
                                               {"request_id": req.request_id}) from e
                    finally:
                        if both.done() and not both.cancelled():
                            both.exception()  # raised above, or a cancellation of its parts: seen either way
            marks.append(("reads", time.perf_counter()))
            confirm_sent = time.perf_counter()
            if claimed is None:
                await claim_all(legs, own, self._rpc_timeout(deadline), consumed=True)
                recorded.append(functools.partial(self.node.metrics.lease_call, "claim_consumed",
                                                  time.perf_counter() - confirm_sent))
            else:
                if any(leg.clock is not None and leg.clock.expired for leg in legs):
                    raise FailedPrecondition("LEASE_EXPIRED", "the reads finished after the lease ran out",
                                             {"request_id": p.remote_request_id})
                await confirm_all(legs, own, self._rpc_timeout(deadline))
                recorded.append(functools.partial(self.node.metrics.lease_call, "confirm",
                                                  time.perf_counter() - confirm_sent))
        except BaseException as e:
            # Run to its end even if the job is cancelled meanwhile: the job ends (and its
            # request is reported settled) only once no READ of it can still write.
            final = await _to_the_end(self._failed(e, legs, own, posted, deadline, claimed, reads_done,
                                                   span, clock))
            if final is e:
                raise
            raise final from None if isinstance(e, ClaimRefused) else e
        finally:
            for k in keepers:
                k.cancel()
        marks.append(("confirm", time.perf_counter()))
        recorded.append(functools.partial(self.node.metrics.phases, marks, started))
        record_phases(span, clock, started, marks)
        if log.isEnabledFor(logging.DEBUG):
            prev, phases = started, []
            for name, at in marks:
                phases.append(f"{name} {1e3 * (at - prev):.2f} ms")
                prev = at
            log.debug("transfer %s: %s", req.request_id, ", ".join(phases))
        per_rank: dict[int, pb.RankTransferResult] = {
            t: pb.RankTransferResult(local_rank=t) for t in node.hosted_ranks}
        for x in posted:
            r = per_rank[x.rank]
            r.bytes += x.nbytes
            r.num_descriptors += x.descriptors
            r.duration_us = max(r.duration_us, int(x.flight.result.result() * 1e6))
        return pb.TransferResponse(ranks=list(per_rank.values()), total_bytes=sum(x.nbytes for x in posted),
                                   duration_us=int((time.perf_counter() - started) * 1e6))

    def _claim(self, legs: list[Leg], own: Ownership, deadline: float, span: trace.Span,
               clock: Clock) -> asyncio.Future[None]:
        """Send the claim now -- a long read runs, or a READ failed and P should say why --
        its answer measured and traced."""
        claimed = asyncio.ensure_future(claim_all(legs, own, self._rpc_timeout(deadline)))
        sent = time.perf_counter()

        def answered(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                now = time.perf_counter()
                self.node.metrics.lease_call("claim", now - sent)
                record_span(span, clock, "claim", sent, now)

        claimed.add_done_callback(answered)
        return claimed

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _rpc_timeout(self, deadline: float) -> float:
        """A peer RPC's timeout: the configured one, but never past the job's deadline."""
        return max(0.05, min(self.node.config.peer_timeout_s, deadline - time.monotonic()))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._keep(asyncio.get_running_loop().create_task(coro))

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a background task until it ends (close() waits for them)."""
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)  # type: ignore[arg-type]

    async def _abort_unpaired(self, p: pb.TransferParams) -> None:
        """Best-effort ABORTED (with the lease token) to every P server of a request we could not
        pair with or plan: their leases would otherwise wait out the TTL."""
        opts = dataclasses.replace(peer_client_options(self.node, p.remote_engine_id), timeout_s=2.0, retries=0)
        answers = await abort_published(p, engine_id=self.node.config.engine_id, options=opts)
        for address, answer in answers.items():
            if not answer.startswith("LEASE_STATE_"):
                log.warning("could not tell %s that %s was refused: %s", address, p.remote_request_id, answer)

    async def _failed(self, e: BaseException, legs: list[Leg], own: Ownership, posted: list[Posted],
                      deadline: float, claimed: asyncio.Future[None] | None,
                      reads_done: asyncio.Future[None] | None, span: trace.Span, clock: Clock) -> BaseException:
        """The one failure path of a transfer whose READs may have been posted: the error to raise.

        A cancelled or lost claim may have gone through: it is aborted like any failure. A
        refused one is P's answer to pass on (it explains a READ that failed alongside, e.g.
        from a P that restarted), once the READs it raced with settled.
        """
        if reads_done is not None and reads_done.done() and not reads_done.cancelled():
            reads_done.exception()  # a failed READ: raised above or superseded by err
        err = e.error if isinstance(e, ClaimRefused) else e
        if claimed is None and isinstance(e, KvsvcError) and e.reason in READ_FAILURES:
            # A READ failed before any claim: P's answer explains it better (a P that
            # restarted says LEASE_EXPIRED), and a granted claim is aborted in _fail.
            claimed = self._claim(legs, own, deadline, span, clock)
        if claimed is not None and not isinstance(e, (ClaimRefused, asyncio.CancelledError)):
            refused = await _claim_refusal(claimed, min(self._rpc_timeout(deadline), _until(_answer_by(deadline))))
            err = refused.error if refused is not None else e
        return await self._fail(legs, own, posted, err, deadline, claimed)

    async def _fail(self, legs: list[Leg], own: Ownership, posted: list[Posted], err: BaseException,
                    deadline: float, claimed: asyncio.Future[None] | None = None) -> BaseException:
        """Settle posted READs, tell every P server that may hold our claim to let go, and
        attach which blocks are valid (none).

        Returns the error to raise: a failure whose P server no longer answers becomes
        PEER_UNAVAILABLE naming it (retryable elsewhere), not an internal error.
        """
        unsettled = [x.flight for x in posted if not x.flight.settled.is_set()]
        if unsettled:
            # Cancel what NIXL can, then wait for every READ to end: D's blocks must not be
            # written after the caller was told the transfer failed. Never given up on (this
            # runs under _to_the_end: a cancel of the job does not reach it).
            await self.node.require_data_plane("Transfer").abort(unsettled)
            waited = asyncio.gather(*(f.settled.wait() for f in unsettled))
            try:
                await asyncio.wait_for(asyncio.shield(waited), DRAIN_WARN_S)
            except TimeoutError:
                log.error("READs of %s still in flight after %.0f s", own.params.remote_request_id, DRAIN_WARN_S)
                await waited
        # The READs settled: from here on only P's answers are waited for, and only until
        # the answer is due (the caller's deadline less the margin's last half), so a P
        # that stalls cannot turn the typed answer into a bare DEADLINE_EXCEEDED. What P has
        # not answered by then is told on in the background.
        answer_by = _answer_by(deadline)
        if time.monotonic() >= answer_by:
            # READs that outlived the deadline made the answer late anyway (the caller asks
            # WaitTransfer): P gets a short while to confirm, for remote_notified.
            answer_by = time.monotonic() + LATE_ANSWER_WAIT_S
        if claimed is not None and not claimed.done():
            # Learn whether P granted or refused the claim (refused: no abort owed); one
            # still unanswered stays "sent" and is aborted like a granted one.
            await asyncio.wait([claimed], timeout=_until(answer_by))
        if claimed is not None and claimed.done() and not claimed.cancelled():
            claimed.exception()  # its error is err's cause or was already raised; seen here either way
        aborting = asyncio.ensure_future(abort_all(legs, own, ABORT_TIMEOUT_S))
        await asyncio.wait([aborting], timeout=_until(answer_by))
        if aborting.done():
            notified, gone = aborting.result()
        else:
            self._keep(aborting)
            # Not answered in time: not known to be told; for a failed READ, a P that does
            # not answer is taken as gone (as one that answered UNAVAILABLE is).
            notified, gone = False, [leg.peer.address for leg in legs]
        failure = pb.TransferFailure(valid_local_block_ids_per_group=[], remote_notified=notified)
        final: BaseException = err
        p_unreachable = isinstance(err, KvsvcError) and err.code is ErrorCode.UNAVAILABLE and err.reason == "UNAVAILABLE"
        read_failed = isinstance(err, KvsvcError) and err.reason in READ_FAILURES
        if p_unreachable or (read_failed and gone):
            address = gone[0] if gone else legs[0].peer.address
            final = Unavailable("PEER_UNAVAILABLE", f"prefill server {address} stopped answering: {err}",
                                {"address": address})
        if isinstance(final, KvsvcError):
            final.details = (*final.details, failure)
        elif not isinstance(final, asyncio.CancelledError):
            log.exception("transfer %s failed", own.params.remote_request_id, exc_info=err)
        return final
