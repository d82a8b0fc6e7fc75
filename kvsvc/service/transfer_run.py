"""One Transfer on a D server, from its paired P servers to its answer.

A TransferRun goes through its phases in order:

1. plan -- the pair checked against the params (TP, DCP), then the READs of every hosted
   rank planned; a failure here posted nothing, so it raises and the Decoder's guard gives
   P its lease back at once;
2. post -- the READs handed to NIXL (short ones posted inline, already running);
3. wait -- until the READs end; a READ still running after EARLY_CLAIM_S claims the lease
   while it runs (the claim extends the lease, heartbeats keep it, a router can no longer
   abort it);
4. confirm -- one lease message: claim-and-consumed after short READs, or the confirm of
   the early claim (sent after the answer when D's clock proves P still held that claim
   of a whole lease: see _confirm); with content_digest, D hashes what landed meanwhile and checks it
   against the digests P answered the claim with (service/content.py) -- for a progressive
   lease, those that came with its commits, checked over every chunk's READs.

Any failure from post on takes one path (_failed, then _fail): the READs settle before
anything else is said, P's answer to a claim is learnt, every P server is told to let go,
and the error carries TransferFailure (no block valid). Reading first and claiming after
is safe because P grants the claim only if the lease was never released since it was
published, and frees blocks only on release (docs/RELIABILITY.md, promise 1).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from opentelemetry import trace

from kvsvc.codec import block_ids_from_proto
from kvsvc.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvsvcError,
    Unavailable,
    Unreachable,
)
from kvsvc.leases.table import blocks_digest
from kvsvc.mapping.geometry import check_block_ids
from kvsvc.mapping.planner import Layers, RankPlan, Side
from kvsvc.mapping.progressive import ProgressiveBlocks
from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service import content
from kvsvc.service.commit_follower import COMMIT_WAIT_MARGIN_S, CommitFollower, group_shapes
from kvsvc.service.legs import (
    PENDING_LEASE_WAIT_S,
    ClaimRefused,
    Leg,
    Ownership,
    abort_all,
    claim_all,
    confirm_all,
    heartbeat,
)
from kvsvc.service.node import Node
from kvsvc.service.peers import RemoteRank
from kvsvc.service.tracing import Clock, record_phases, record_span, traceparent
from kvsvc.transport.ports import Flight, TransferError
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

# A failed transfer cancels its READs and waits for every one to end before it answers
# (D's blocks must not be written after the caller was told they are invalid). A READ
# still not ended this long after (a link gone dead that UCX has not given up on), or one
# a stopped data plane can no longer end or report on, is quarantined: the answer says so
# (TransferFailure.quarantined), and the job settles only once every such READ ended.
QUARANTINE_AFTER_S = 10.0
# The least time left a failed transfer keeps for its answer (see _answer_by).
MIN_DEADLINE_MARGIN_S = 0.05
# How long D goes on telling P that a failed transfer let go (after its answer, when P
# did not answer in time).
ABORT_TIMEOUT_S = 2.0
# How long the CONSUMED sent after a transfer's answer waits for P (_confirm_after_answer).
CONFIRM_AFTER_ANSWER_TIMEOUT_S = 10.0
# How long P's answers are waited for when the READs settled after the answer was due.
LATE_ANSWER_WAIT_S = 0.2
# How a failed READ is reported (the data plane's post errors and _all_read's).
READ_FAILURES = (Reason.TRANSFER_FAILED, Reason.NIXL_ERROR)
# READs still running this long after they were posted claim the lease before they end;
# shorter ones claim it and report it consumed in one message.
EARLY_CLAIM_S = 0.01

Read = tuple[int, tuple[RemoteRank, np.ndarray, np.ndarray, np.ndarray]]
"""(local rank, (remote rank, local addresses, remote addresses, lengths)): one READ to post."""


@dataclass
class Posted:
    rank: int
    flight: Flight
    nbytes: int
    descriptors: int


class TransferRun:
    """One Transfer over paired legs: plan(), then execute() (see the module's docstring)."""

    def __init__(self, node: Node, req: pb.TransferRequest, legs: list[Leg], deadline: float,
                 recorded: list[Callable[[], None]], keep: Callable[[asyncio.Future[Any]], None],
                 quarantine: Callable[[list[asyncio.Event], int], None] = lambda _events, _nbytes: None) -> None:
        self.node, self.req, self.p, self.legs = node, req, req.params, legs
        self._quarantine = quarantine  # the job's: settle only once these READs ended
        self.deadline = deadline
        self.recorded = recorded  # metrics to record once the job was answered
        self._keep = keep  # holds a background task until it ends (the Decoder waits for them on close)
        self.started = time.perf_counter()
        self.marks: list[tuple[str, float]] = []
        self.span, self.clock = trace.get_current_span(), Clock()
        self.posted: list[Posted] = []
        self.pulled: list[Read] = []  # a progressive lease's READs, every chunk's (checked at the end)
        self.claimed: asyncio.Future[None] | None = None  # an early claim, once sent
        self.keepers: list[asyncio.Future[None]] = []  # its heartbeats
        self.reads_done: asyncio.Future[None] | None = None
        self.own: Ownership | None = None
        self.growing: ProgressiveBlocks | None = None  # a progressive lease's progress (plan: _follow)
        self.chunks = {False: 0, True: 0}  # chunks read while the lease grew (False) and after its final commit
        self.final_heard: float | None = None  # when D heard of P's final commit (progressive)
        self.follower: CommitFollower

    # ---- phases ---------------------------------------------------------------------

    def plan(self) -> list[Read]:
        """Check the pair against the params and plan every hosted rank's READs. Raises
        before anything is posted (the caller gives P its lease back)."""
        node, p = self.node, self.p
        side = self.legs[0].peer.side
        for leg in self.legs:
            if (p.remote_tp_size and p.remote_tp_size != leg.peer.tp_size) or leg.peer.side != side:
                raise InvalidArgument(Reason.TP_MISMATCH, f"params say remote TP {p.remote_tp_size} but "
                                      f"{leg.peer.address} runs TP {leg.peer.tp_size} (or another layout)",
                                      {"params_tp_size": p.remote_tp_size, "remote_tp_size": leg.peer.tp_size})
        if (p.remote_dcp_size or 1) != side.layout.dcp_size:
            # The servers to claim at were chosen by the params' DCP size: a wrong one misses ranks.
            raise InvalidArgument(Reason.DCP_MISMATCH, f"params say remote DCP {p.remote_dcp_size or 1} but the prefill "
                                  f"engine runs DCP {side.layout.dcp_size}",
                                  {"params_dcp_size": p.remote_dcp_size, "remote_dcp_size": side.layout.dcp_size})
        local_ids = block_ids_from_proto(self.req.local_block_ids_per_group)
        self.fault = node.faults.next_transfer() if node.faults is not None else None
        if p.progressive:
            self.growing = self._follow(side, local_ids)
            self.marks.append(("plan", time.perf_counter()))
            return []  # planned chunk by chunk as P commits (_pull)
        remote_ids = block_ids_from_proto(p.remote_block_ids_per_group)
        reads = self._reads(side, local_ids, remote_ids, p.remote_num_tokens)
        self.marks.append(("plan", time.perf_counter()))
        self.own = Ownership(p, node.config.engine_id, node.config.tp_size, secrets.token_hex(16),
                             node.layout.dcp_size, traceparent(self.span), blocks_digest(remote_ids, p.remote_num_tokens),
                             want_content=node.config.content_digest)
        self.remote_ids = remote_ids
        return reads

    def _reads(self, side: Side, local_ids: Sequence[Sequence[int] | np.ndarray],
               remote_ids: Sequence[Sequence[int] | np.ndarray], remote_num_tokens: int,
               layers: Layers | None = None) -> list[Read]:
        node = self.node
        ranks = {r: rr for leg in self.legs for r, rr in leg.peer.ranks.items()}
        plans = node.plan(side, local_ids, remote_ids, node.hosted_ranks, validated=True,
                          remote_num_tokens=remote_num_tokens, layers=layers)
        return [(plan.local_rank, a) for plan in plans for a in _addresses(node, ranks, plan)]

    def _follow(self, side: Side, local_ids: list[list[int]]) -> ProgressiveBlocks:
        """A progressive lease's transfer: D's blocks aligned from the request's start (after
        the prefix it holds), and a claim that carries no digest (the blocks are not all
        known yet) and asks for no content (the content digests come with the commits)."""
        node, p = self.node, self.p
        if node.layout.dcp_size > 1 or side.layout.dcp_size > 1:
            raise FailedPrecondition(Reason.LEASE_NOT_PROGRESSIVE, "progressive leases are not pulled between "
                                     "engines with DCP yet: lease the request whole",
                                     {"dcp_size": node.layout.dcp_size, "remote_dcp_size": side.layout.dcp_size})
        if len(local_ids) != len(node.layout.groups):
            raise InvalidArgument(Reason.UNKNOWN_GROUP, f"local block ids name {len(local_ids)} groups but the "
                                  f"layout has {len(node.layout.groups)}",
                                  {"side": "local", "given_groups": len(local_ids),
                                   "layout_groups": len(node.layout.groups)})
        for g, ids in enumerate(local_ids):  # all of them before the first READ, as a plain plan does
            check_block_ids(np.asarray(ids, np.int64), node.layout.group_blocks(g), side="local", group=g)
        self.own = Ownership(p, node.config.engine_id, node.config.tp_size, secrets.token_hex(16),
                             node.layout.dcp_size, traceparent(self.span))
        self.follower = CommitFollower(self.legs, self.own, [g.num_layers for g in node.layout.groups],
                                       want_content=node.config.content_digest,
                                       on_unanswered=node.metrics.commit_wait_unanswered)
        return ProgressiveBlocks(local_ids, group_shapes(node.layout), prefix_tokens=self.req.local_prefix_tokens,
                                 local_block_size=node.layout.block_size, remote_block_size=side.layout.block_size)

    async def execute(self, reads: list[Read]) -> pb.TransferResponse:
        """Post, wait, confirm; every failure through one path. Answers only once no READ of
        it can still write, whatever happened (a cancel of the job included)."""
        try:
            if self.growing is not None:
                await self._pull()
                if self._inject("corrupt_landed"):
                    _flip_a_landed_byte(self.node, self.pulled)
                landed = self._hash_landed(self.pulled)  # every chunk's, on a worker thread, while P confirms
            else:
                await self._post(reads)
                self.marks.append(("post", time.perf_counter()))
                self._inject("cancel_mid_read")
                await self._wait()
                self.marks.append(("reads", time.perf_counter()))
                self._inject("read_error")
                if self._inject("corrupt_landed"):
                    _flip_a_landed_byte(self.node, reads)
                landed = self._hash_landed(reads)  # on a worker thread, while P confirms
            try:
                await self._confirm()
            finally:
                if landed is not None:
                    landed_digests = await asyncio.shield(landed)
            if landed is not None:
                self._check_content(landed_digests)
        except BaseException as e:
            # Run to its end even if the job is cancelled meanwhile: the job ends (and its
            # request is reported settled) only once no READ of it can still write.
            final = await _to_the_end(self._failed(e))
            if final is e:
                raise
            raise final from None if isinstance(e, ClaimRefused) else e
        finally:
            for k in self.keepers:
                k.cancel()
        self.marks.append(("confirm", time.perf_counter()))
        self._record_phases()
        return self._response()

    async def _post(self, reads: list[Read]) -> None:
        data = self.node.require_data_plane("Transfer")
        for t, (rr, la, ra, ln) in reads:
            now = data.read_now(t, rr.agent_name, la, ra, ln, rr.memory_kind, rr.device_id)
            if now is not None:  # a short READ, posted already: nothing to wait for or cancel
                self.posted.append(Posted(t, now, int(ln.sum()), int(ln.size)))
                continue
            post = asyncio.ensure_future(data.read(t, rr.agent_name, la, ra, ln, rr.memory_kind, rr.device_id))
            try:
                await asyncio.shield(post)
            except asyncio.CancelledError:
                # Cancelled while the NIXL thread posts: the READ runs anyway, so it must be
                # known here to be settled before anyone hears the blocks are free.
                if not post.cancelled() and (post.done() or await _settle_post(post)):
                    self.posted.extend(_parts(t, post.result(), ln))
                raise
            self.posted.extend(_parts(t, post.result(), ln))

    async def _pull(self) -> None:
        """A progressive lease's READs: claim it at once, then read each chunk as P commits
        it while waiting (on P, never polling) for the next, until the final commit's blocks
        were read. The lease is kept alive by the waits and by heartbeats; the confirm after
        is the early claim's (it is refused until the lease is final)."""
        growing, follower = self.growing, self.follower
        assert growing is not None and self.own is not None
        self.claimed = claimed = self._claim()
        self.keepers = [asyncio.ensure_future(heartbeat(leg, self.own, claimed)) for leg in self.legs]
        await claimed
        first = True
        while not growing.done:
            had = follower.epoch
            await self._reads_ended()
            await follower.wait(self._left(), reads_done=True)
            if follower.epoch == had and self._left() <= COMMIT_WAIT_MARGIN_S:
                # Nothing new, and no time left to wait for it on P (never asked again at once).
                raise DeadlineExceeded(Reason.DEADLINE_EXCEEDED, "the prefill engine had not committed the "
                                       "request's last blocks by the deadline",
                                       {"request_id": self.req.request_id, "commit_epoch": follower.epoch})
            if follower.final and self.final_heard is None:
                self.final_heard = time.perf_counter()  # what follows is the transfer's unhidden part
            _check_ended_reads(self.posted)  # a READ of an earlier chunk that failed ends the stream now
            committed = follower.committed()
            chunks = growing.next(committed, num_tokens=follower.num_tokens, final=follower.final,
                                  partial=follower.partial(committed))
            if not chunks:
                continue
            for chunk in chunks:  # (a chunk committed layer by layer: some layers of its blocks)
                reads = self._reads(self.legs[0].peer.side, chunk.local, chunk.remote, 0, chunk.layers)
                self.pulled.extend(reads)
                await self._post(reads)
            self.recorded.append(functools.partial(self.node.metrics.progressive_read, not follower.final))
            self.chunks[follower.final] += 1
            if first:
                first = False
                self.marks.append(("post", time.perf_counter()))
                self._inject("cancel_mid_read")
        self.reads_done = reads_done = asyncio.ensure_future(_all_read(self.posted))
        try:
            async with asyncio.timeout(self._left()):
                await asyncio.shield(reads_done)
        except TimeoutError as e:
            raise self._reads_late() from e
        self.marks.append(("reads", time.perf_counter()))
        self._inject("read_error")

    async def _reads_ended(self) -> None:
        """Until the READs posted so far ended (failed ones are found after): D asks for the
        next commit only then, saying so, and P -- over TCP, where its process moves a READ's
        bytes -- progresses its data plane only while a READ of the lease may run, not for
        the whole prefill. The next commit is not missed: P answers at once when one came."""
        running = [x.flight.result for x in self.posted if not x.flight.result.done()]
        if not running:
            return
        try:
            async with asyncio.timeout(self._left()):
                await asyncio.wait(running)  # cancels none of them, raises none of their errors
        except TimeoutError as e:
            raise self._reads_late() from e

    def _reads_late(self) -> DeadlineExceeded:
        return DeadlineExceeded(Reason.DEADLINE_EXCEEDED, "the reads did not finish before the deadline",
                                {"request_id": self.req.request_id})

    async def _wait(self) -> None:
        """Until the READs end; one still running after EARLY_CLAIM_S claims the lease meanwhile."""
        if all(x.flight.result.done() for x in self.posted):
            _check_read(self.posted)  # short READs often end inside their post: nothing to wait for
            return
        self.reads_done = reads_done = asyncio.ensure_future(_all_read(self.posted))
        try:
            async with asyncio.timeout(min(EARLY_CLAIM_S, self._left())):  # not wait_for:
                await asyncio.shield(reads_done)  # in 3.11 it can swallow a cancel that races the result
            return
        except TimeoutError:
            pass
        self.claimed = claimed = self._claim()
        assert self.own is not None
        self.keepers = [asyncio.ensure_future(heartbeat(leg, self.own, claimed)) for leg in self.legs]
        both = asyncio.gather(claimed, reads_done)
        try:
            async with asyncio.timeout(self._left()):
                await both
        except TimeoutError as e:
            raise self._reads_late() from e
        finally:
            if both.done() and not both.cancelled():
                both.exception()  # raised above, or a cancellation of its parts: seen either way

    async def _confirm(self) -> None:
        """The one lease message after the READs: claim-and-consumed, or the early claim's confirm."""
        assert self.own is not None
        sent = time.perf_counter()
        if self.claimed is None:
            await claim_all(self.legs, self.own, self.rpc_timeout(), consumed=True)
            self.recorded.append(functools.partial(self.node.metrics.lease_call, "claim_consumed",
                                                   time.perf_counter() - sent))
            self._inject("claim_lost")
            return
        if any(leg.clock is not None and leg.clock.expired for leg in self.legs):
            raise FailedPrecondition(Reason.LEASE_EXPIRED, "the reads finished after the lease ran out",
                                     {"request_id": self.p.remote_request_id})
        if self.growing is None and all(leg.clock is not None and leg.clock.holds for leg in self.legs):
            # Every P server still holds our claim by D's own clock (LeaseClock.held_until),
            # and a claimed lease made whole is released only by its claimant or its expiry:
            # the READs that just ended read blocks nobody could free under them. The grant
            # is the proof, and the CONSUMED goes after the answer, so a P whose loop is
            # busy (prefilling the next requests) does not hold D's first token. Not for a
            # progressive lease: its engine may withdraw it while claimed (preemption), and
            # only P's answer says it did not.
            self._inject("claim_lost")
            self._keep(asyncio.ensure_future(self._confirm_after_answer()))
            return
        await confirm_all(self.legs, self.own, self.rpc_timeout())
        self.recorded.append(functools.partial(self.node.metrics.lease_call, "confirm", time.perf_counter() - sent))
        self._inject("claim_lost")

    async def _confirm_after_answer(self) -> None:
        """The early claim's CONSUMED, sent once the transfer answered: P frees its blocks
        now instead of at the lease's end. Failing is no failure of the transfer (its bytes
        were proven by the claim): P then frees them when the lease runs out."""
        assert self.own is not None
        sent = time.perf_counter()
        try:
            await confirm_all(self.legs, self.own, CONFIRM_AFTER_ANSWER_TIMEOUT_S)
        except Exception as e:
            log.warning("transfer %s: P did not take the consumed report of %s (%s); its lease ends at its TTL",
                        self.req.request_id, self.p.remote_request_id, e)
            return
        self.node.metrics.lease_call("confirm", time.perf_counter() - sent)

    # ---- injected faults (service/faults.py: tests only) -------------------------------

    def _inject(self, point: str) -> bool:
        """This transfer's fault, at its point: the failure it stands for is raised here
        (corrupt_landed: True, the caller flips a byte)."""
        if self.fault != point:
            return False
        assert self.node.faults is not None
        self.node.faults.injected_now(point)
        if point == "cancel_mid_read":
            raise Cancelled("injected fault: the transfer is given up while its READs run")
        if point == "read_error":
            raise KvsvcError(Reason.NIXL_ERROR, "injected fault: a READ failed")
        if point == "claim_lost":
            raise Unreachable("injected fault: the answer to the claim was lost")
        return True

    # ---- content digests --------------------------------------------------------------

    def _hash_landed(self, reads: list[Read]) -> asyncio.Future[dict[int, tuple[dict[tuple[int, int], int], int]]] | None:
        if not self.node.config.content_digest:
            return None
        p_regions = self.legs[0].peer.side.pool.regions
        return asyncio.get_running_loop().run_in_executor(None, content.landed, self.node, p_regions, reads)

    def _check_content(self, landed: dict[int, tuple[dict[tuple[int, int], int], int]]) -> None:
        if self.growing is not None:  # the digests came with the commits
            expected = self.follower.expected_content()
        else:
            expected = content.expected(self.remote_ids, [c for leg in self.legs for c in leg.content])
        try:
            checked, unchecked = content.check(self.req.request_id, expected, landed)
        except KvsvcError:
            self.recorded.append(self.node.metrics.content_mismatch)
            raise
        self.recorded.append(functools.partial(self.node.metrics.content_checked, checked, unchecked))

    # ---- the answer -----------------------------------------------------------------

    def _record_phases(self) -> None:
        self.recorded.append(functools.partial(self.node.metrics.phases, self.marks, self.started))
        record_phases(self.span, self.clock, self.started, self.marks)
        if log.isEnabledFor(logging.DEBUG):
            prev, phases = self.started, []
            for name, at in self.marks:
                phases.append(f"{name} {1e3 * (at - prev):.2f} ms")
                prev = at
            log.debug("transfer %s: %s", self.req.request_id, ", ".join(phases))

    def _response(self) -> pb.TransferResponse:
        per_rank: dict[int, pb.RankTransferResult] = {
            t: pb.RankTransferResult(local_rank=t) for t in self.node.hosted_ranks}
        for x in self.posted:
            r = per_rank[x.rank]
            r.bytes += x.nbytes
            r.num_descriptors += x.descriptors
            r.duration_us = max(r.duration_us, int(x.flight.result.result() * 1e6))
        now = time.perf_counter()
        return pb.TransferResponse(ranks=list(per_rank.values()), total_bytes=sum(x.nbytes for x in self.posted),
                                   duration_us=int((now - self.started) * 1e6),
                                   chunks_read_growing=self.chunks[False], chunks_read_final=self.chunks[True],
                                   after_final_us=int((now - self.final_heard) * 1e6) if self.final_heard else 0)

    # ---- claims and failures ----------------------------------------------------------

    def _claim(self) -> asyncio.Future[None]:
        """Send the claim now -- a long read runs, or a READ failed and P should say why --
        its answer measured and traced."""
        assert self.own is not None
        timeout_s = self.rpc_timeout()
        if self.growing is not None and self.req.params.lease_pending:
            # A streamed request's D may come before P's engine took the request in: its claim
            # waits for the lease as long as a pending claim may (not one RPC's timeout).
            timeout_s = max(0.05, min(max(timeout_s, PENDING_LEASE_WAIT_S), self._left()))
        claimed = asyncio.ensure_future(claim_all(self.legs, self.own, timeout_s))
        sent = time.perf_counter()

        def answered(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                now = time.perf_counter()
                self.node.metrics.lease_call("claim", now - sent)
                record_span(self.span, self.clock, "claim", sent, now)

        claimed.add_done_callback(answered)
        return claimed

    async def _failed(self, e: BaseException) -> BaseException:
        """The one failure path of a transfer whose READs may have been posted: the error to raise.

        A cancelled or lost claim may have gone through: it is aborted like any failure. A
        refused one is P's answer to pass on (it explains a READ that failed alongside, e.g.
        from a P that restarted), once the READs it raced with settled.
        """
        reads_done = self.reads_done
        if reads_done is not None and reads_done.done() and not reads_done.cancelled():
            reads_done.exception()  # a failed READ: raised above or superseded by err
        err = e.error if isinstance(e, ClaimRefused) else e
        if self.claimed is None and isinstance(e, KvsvcError) and e.reason in READ_FAILURES:
            # A READ failed before any claim: P's answer explains it better (a P that
            # restarted says LEASE_EXPIRED), and a granted claim is aborted in _fail.
            self.claimed = self._claim()
        if self.claimed is not None and not isinstance(e, (ClaimRefused, asyncio.CancelledError)):
            refused = await _claim_refusal(self.claimed, min(self.rpc_timeout(), _until(self._answer_by())))
            err = refused.error if refused is not None else e
        return await self._fail(err)

    async def _fail(self, err: BaseException) -> BaseException:
        """Settle posted READs, tell every P server that may hold our claim to let go, and
        attach which blocks are valid (none).

        Returns the error to raise: a failure whose P server no longer answers becomes
        PEER_UNAVAILABLE naming it (retryable elsewhere), not an internal error.
        """
        unsettled = await self._settle_reads()
        if unsettled:
            self._quarantine([f.settled for f in unsettled], sum(x.nbytes for x in self.posted))
        # The READs settled (or are quarantined): from here on only P's answers are waited for, and only until
        # the answer is due (the caller's deadline less the margin's last half), so a P
        # that stalls cannot turn the typed answer into a bare DEADLINE_EXCEEDED. What P has
        # not answered by then is told on in the background.
        answer_by = self._answer_by()
        if time.monotonic() >= answer_by:
            # READs that outlived the deadline made the answer late anyway (the caller asks
            # WaitTransfer): P gets a short while to confirm, for remote_notified.
            answer_by = time.monotonic() + LATE_ANSWER_WAIT_S
        claimed = self.claimed
        if claimed is not None and not claimed.done():
            # Learn whether P granted or refused the claim (refused: no abort owed); one
            # still unanswered stays "sent" and is aborted like a granted one.
            await asyncio.wait([claimed], timeout=_until(answer_by))
        if claimed is not None and claimed.done() and not claimed.cancelled():
            claimed.exception()  # its error is err's cause or was already raised; seen here either way
        notified, gone = await self._abort(answer_by)
        return self._final_error(err, notified, gone, quarantined=bool(unsettled))

    async def _settle_reads(self) -> list[Flight]:
        """Cancel what NIXL can, then wait for every READ to end: D's blocks must not be
        written after the caller was told the transfer failed. Returns the READs that did not
        end within QUARANTINE_AFTER_S, or that a stopped data plane can no longer end or
        report on (they may still land: an RDMA NIC needs no thread): quarantined. Runs under
        _to_the_end: a cancel of the job does not reach it."""
        unsettled = [x.flight for x in self.posted if not x.flight.settled.is_set()]
        if not unsettled:
            return []
        data = self.node.data
        if data is None or not data.alive:
            log.error("transfer %s: %d READs in flight when the data plane stopped: quarantined",
                      self.req.request_id, len(unsettled))
            return unsettled
        await data.abort(unsettled)
        waited = asyncio.gather(*(f.settled.wait() for f in unsettled))
        try:
            await asyncio.wait_for(asyncio.shield(waited), QUARANTINE_AFTER_S)
        except TimeoutError:
            waited.cancel()  # its end (a cancelled READ wait) is nobody's news: seen here
            waited.add_done_callback(lambda f: None if f.cancelled() else f.exception())
            still = [f for f in unsettled if not f.settled.is_set()]
            log.error("transfer %s: %d READs still in flight %.0f s after it failed: quarantined until they end",
                      self.req.request_id, len(still), QUARANTINE_AFTER_S)
            return still
        return []

    async def _abort(self, answer_by: float) -> tuple[bool, list[str]]:
        """Tell every P server to let go, until answer_by (then on in the background):
        (whether all were told, the addresses that did not answer)."""
        assert self.own is not None
        aborting = asyncio.ensure_future(abort_all(self.legs, self.own, ABORT_TIMEOUT_S))
        await asyncio.wait([aborting], timeout=_until(answer_by))
        if aborting.done():
            return aborting.result()
        self._keep(aborting)
        # Not answered in time: not known to be told; for a failed READ, a P that does
        # not answer is taken as gone (as one that answered UNAVAILABLE is).
        return False, [leg.peer.address for leg in self.legs]

    def _final_error(self, err: BaseException, notified: bool, gone: list[str], *,
                     quarantined: bool = False) -> BaseException:
        failure = pb.TransferFailure(valid_local_block_ids_per_group=[], remote_notified=notified,
                                     quarantined=quarantined)
        final: BaseException = err
        p_unreachable = isinstance(err, Unreachable)
        read_failed = isinstance(err, KvsvcError) and err.reason in READ_FAILURES
        if p_unreachable or (read_failed and gone):
            address = gone[0] if gone else self.legs[0].peer.address
            final = Unavailable(Reason.PEER_UNAVAILABLE, f"prefill server {address} stopped answering: {err}",
                                {"address": address})
        if isinstance(final, KvsvcError):
            final.details = (*final.details, failure)
        elif not isinstance(final, asyncio.CancelledError):
            log.exception("transfer %s failed", self.p.remote_request_id, exc_info=err)
        return final

    # ---- time -----------------------------------------------------------------------

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def rpc_timeout(self) -> float:
        """A peer RPC's timeout: the configured one, but never past the job's deadline."""
        return max(0.05, min(self.node.config.peer_timeout_s, self.deadline - time.monotonic()))

    def _answer_by(self) -> float:
        """When a failed transfer's answer is due: its deadline (the caller's less the margin)
        plus half the least margin, the other half left for the answer to reach the caller."""
        return self.deadline + MIN_DEADLINE_MARGIN_S / 2


def _flip_a_landed_byte(node: Node, reads: list[Read]) -> None:
    """corrupt_landed: the first byte the first READ into host memory landed, inverted."""
    for t, (_rr, la, _ra, ln) in reads:
        if len(ln) and node.pools[t].memory_kind is MemoryKind.DRAM:
            byte = ctypes.c_ubyte.from_address(int(la[0]))
            byte.value ^= 0xFF
            return


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
            raise FailedPrecondition(Reason.PEER_RANKS_MISSING, f"prefill rank {reads.remote_rank} was not in the "
                                     "handshake", {"rank": reads.remote_rank})
        out.append((rr, local_base[reads.local_region] + reads.local_offset,
                    rr.bases[reads.remote_region] + reads.remote_offset, reads.length))
    return out


def _parts(rank: int, flights: list[Flight], length: np.ndarray) -> list[Posted]:
    """A READ posted in parts (copy lanes): the first carries its bytes and descriptors,
    so the answer counts the READ once; each part is waited for and settled."""
    return [Posted(rank, fl, int(length.sum()) if i == 0 else 0, int(length.size) if i == 0 else 0)
            for i, fl in enumerate(flights)]


async def _all_read(posted: list[Posted]) -> None:
    """Until every posted READ completed; TRANSFER_FAILED when one failed."""
    try:
        await asyncio.gather(*(x.flight.result for x in posted))
    except TransferError as e:
        raise Internal(Reason.TRANSFER_FAILED, f"a READ failed: {e}") from e


def _check_ended_reads(posted: list[Posted]) -> None:
    """TRANSFER_FAILED when a READ that ended failed (those still running are not waited for)."""
    _check_read([x for x in posted if x.flight.result.done()])


def _check_read(posted: list[Posted]) -> None:
    """For READs that all ended already: TRANSFER_FAILED when one failed (as _all_read says)."""
    for x in posted:
        error = x.flight.result.exception()
        if error is not None:
            raise Internal(Reason.TRANSFER_FAILED, f"a READ failed: {error}") from error


async def _settle_post(post: asyncio.Future[list[Flight]]) -> bool:
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


def _until(t: float) -> float:
    return max(0.0, t - time.monotonic())
