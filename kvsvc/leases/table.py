"""P-side leases: published requests, claims, release accounting, expiry, release events.

The state machine and its quotas live here; what it keeps and says is in records.py, the
per-block holder counts in holders.py, the release subscribers in releases.py, and the
claims waiting for a lease not made yet in arrivals.py.

A lease moves OFFERED -> CLAIMED -> one of CONSUMED / EXPIRED / ABORTED, exactly once. A
progressive lease (opened before the engine's prefill ended) moves the same way and, while
OFFERED or CLAIMED, grows by commits until its final one (commits.py; a consumed report
waits for the final commit); D waits for the next commit on an event (commit_waits).
Expiry is driven by one reaper task that sleeps until the earliest deadline; it never
assumes leases expire in publish order (a claim or heartbeat moves a deadline later).
Released leases stay as tombstones for a while so late claims get LEASE_EXPIRED and
duplicate notifications get the final state.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, PermissionDenied, Unavailable
from kvsvc.leases.arrivals import LeaseArrivals
from kvsvc.leases.commits import CommitLog
from kvsvc.leases.holders import BlockHolders
from kvsvc.leases.records import (
    Claim,
    Lease,
    LeaseState,
    NotifyKind,
    Release,
    Tombstone,
    blocks_digest,
    claim_digest,
    monotonic_to_unix_ms,
    new_lease_token,
    unix_ms,
)
from kvsvc.leases.releases import MAX_WATCH_BACKLOG_BYTES, SubscriberBehind, Subscription
from kvsvc.mapping.release import ReleaseTracker
from kvsvc.mapping.topology import tp_ratio
from kvsvc.reasons import Reason

log = logging.getLogger(__name__)

__all__ = ["MAX_WATCH_BACKLOG_BYTES", "Claim", "Lease", "LeaseState", "LeaseTable", "NotifyKind", "Release",
           "SubscriberBehind", "Subscription", "Tombstone", "blocks_digest", "monotonic_to_unix_ms",
           "new_lease_token"]

TOMBSTONES_MAX = 100_000
# A reaper that wakes this much later than it planned means this server's event loop did not
# run meanwhile (a GC pause, a thread starved of CPU or of the GIL by its engine): renewals D
# sent in that time sit unread in its sockets. The leases that fell due then get as long
# again, from the moment the loop runs, so those renewals are read before any of them
# expires; keeping blocks longer is always safe, expiring a lease D kept renewing is not.
LOOP_STALL_S = 0.25
MAX_STALL_GRACE_S = 60.0
# A drain that ran out holds claimed leases to their deadlines; it gives up on the reaper
# this long after the last of them (a reaper that is not running).
DEADLINE_HOLD_SLACK_S = 5.0


def _check_token(lease: Lease, token: str) -> None:
    if not secrets.compare_digest(token.encode(), lease.token.encode()):
        raise PermissionDenied(Reason.LEASE_TOKEN_MISMATCH, f"the lease_token does not match request "
                               f"{lease.request_id!r}'s lease: copy TransferParams as PublishBlocks returned them",
                               {"request_id": lease.request_id})


@dataclass
class LeaseTable:
    """Leases of one P server; hosted_ranks, tp_size and dcp_size are this engine's."""

    epoch: int
    hosted_ranks: Sequence[int]
    tp_size: int
    default_ttl_s: float = 30.0
    max_ttl_s: float = 600.0
    # +1 when the first lease a D may be reading goes live, -1 when the last one is released
    # or goes quiet: a D may read a whole lease at any time while it lives (read first, claim
    # after), a progressive one until every claimant said its READs ended and was handed
    # nothing since (WaitCommit reads_done). Where UCX emulates a READ with messages (TCP
    # between hosts, no RDMA) the bytes move only as often as this side progresses UCX, so
    # the data plane's pump runs while this says so.
    on_live_change: Callable[[int], None] = lambda delta: None
    on_release: Callable[[LeaseState], None] = lambda reason: None
    max_live: int = 65_536
    dcp_size: int = 1
    max_leased_blocks: int = 16 * 1024 * 1024  # block ids across live leases (4 bytes each)
    watch_backlog_bytes: int = MAX_WATCH_BACKLOG_BYTES
    max_claims_per_engine: int = 16_384  # claimed leases one D engine may hold at once
    _live: dict[str, Lease] = field(default_factory=dict)
    _quiet: set[str] = field(default_factory=set)  # live progressive leases nobody reads now
    _claims_of: dict[str, int] = field(default_factory=dict)  # D engine id -> claimed leases it holds
    _holders: BlockHolders = field(default_factory=BlockHolders)  # live leases holding each block
    _dead: OrderedDict[str, Tombstone] = field(default_factory=OrderedDict)
    # Aborts, with a token, of leases not made yet (request id -> token): an engine that
    # hands out params before its servers lease the blocks (lease_pending) may hear that D
    # gave the request up first; its publish under that token is then refused at once.
    _aborted_early: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _heap: list[tuple[float, str]] = field(default_factory=list)
    _watchers: set[Subscription] = field(default_factory=set)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _reaper: asyncio.Task[None] | None = None
    _planned: float | None = None  # when the reaper, asleep, means to wake (None: no deadline)
    _graced: set[str] = field(default_factory=set)  # leases given a stall's grace since their last renewal
    _claimed: int = 0
    _serial: int = 0  # leases made so far: the last one's serial
    _no_claims: asyncio.Event = field(default_factory=asyncio.Event)
    _held_to_deadlines: bool = False  # a drain ran out: no renewal extends a lease any more
    accepting: bool = True
    # Claims waiting for leases not made yet (ClaimLeaseRequest.wait_ms): woken by the
    # publish or refusal of their request id.
    arrivals: LeaseArrivals = field(default_factory=LeaseArrivals)
    # D's waits for the next commit of a progressive lease: woken by the commit or the release.
    commit_waits: LeaseArrivals = field(default_factory=lambda: LeaseArrivals(waiting_for="commits"))

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="kvsvc-lease-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
            self._reaper = None
        self.arrivals.close()
        self.commit_waits.close()
        for w in list(self._watchers):
            w.end()

    async def drain(self, timeout_s: float, hold_claims: bool = True) -> int:
        """Stop taking publishes and wait (at most timeout_s) until no lease is claimed; then,
        with hold_claims, until those still claimed reach their deadlines, renewed no more.

        Claimed leases may have READs in flight from D, and D may take its claim's deadline
        as the proof of what it read; unclaimed ones are left to their fate (D's claim will
        fail cleanly once the server is gone). Returns the number of leases still claimed
        when timeout_s ran out.
        """
        self.accepting = False
        self.arrivals.close()  # no lease will be made now: claims waiting for one end
        if not self._claimed:
            return 0
        try:
            await asyncio.wait_for(self._no_claims.wait(), timeout_s)
            return 0
        except TimeoutError:
            left = self._claimed
        if not hold_claims:
            log.warning("%d leases still claimed after %.1f s of draining", left, timeout_s)
            return left
        # A D whose claim holds by its own clock takes the grant as the proof of its READs
        # (transfer_run._confirm): its blocks stay leased until the claim's deadline, which no
        # renewal moves now, and the server stops only then.
        self._held_to_deadlines = True
        last = max((lease.expires_at for lease in self._live.values() if lease.state is LeaseState.CLAIMED),
                   default=time.monotonic())
        log.warning("%d leases still claimed after %.1f s of draining: held, without renewal, until their claims run "
                    "out (%.1f s at most)", left, timeout_s, max(0.0, last - time.monotonic()))
        try:
            async with asyncio.timeout(max(0.0, last - time.monotonic()) + DEADLINE_HOLD_SLACK_S):
                await self._no_claims.wait()  # the reaper expires them at their deadlines
        except TimeoutError:
            log.error("%d claimed leases outlived their deadlines while draining", self._claimed)
        return left

    # ---- operations -----------------------------------------------------------------

    def publish(self, request_id: str, block_ids: list[list[int]], ttl_s: float | None, token: str = "",
                num_tokens: int = 0, progressive: bool = False) -> Lease:
        """Lease request_id's blocks; token is a sibling server's (one engine, one token), else new.
        progressive: the lease is opened with these blocks (maybe none) at commit epoch 1 and
        grows by commit() until its final commit."""
        if not request_id:
            raise InvalidArgument(Reason.MISSING_FIELD, "request_id must be set", {"field": "request_id"})
        if not self.accepting:
            raise Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down and takes no new leases")
        if request_id in self._live:
            raise KvsvcError(Reason.LEASE_EXISTS, f"request {request_id!r} is already published and not yet released",
                             {"request_id": request_id}, code=ErrorCode.ALREADY_EXISTS)
        if len(self._live) >= self.max_live:
            raise KvsvcError(Reason.TOO_MANY_LEASES, f"{len(self._live)} leases are live, the most this server keeps; "
                             "wait for releases", {"live_leases": len(self._live), "max_live_leases": self.max_live},
                             code=ErrorCode.RESOURCE_EXHAUSTED)
        blocks = [np.asarray(ids, dtype=np.uint32) for ids in block_ids]
        self._check_block_quota(blocks)
        ttl = self.default_ttl_s if not ttl_s else ttl_s
        if ttl > self.max_ttl_s:
            raise InvalidArgument(Reason.LEASE_TTL_TOO_LONG, f"lease_ttl_ms {int(ttl * 1000)} exceeds the maximum "
                                  f"{int(self.max_ttl_s * 1000)}", {"lease_ttl_ms": int(ttl * 1000),
                                                                    "max_lease_ttl_ms": int(self.max_ttl_s * 1000)})
        if token and self._aborted_early.get(request_id) == token:
            del self._aborted_early[request_id]
            raise FailedPrecondition(Reason.LEASE_ABORTED, f"request {request_id!r} was aborted (with this lease token) "
                                     "before it was published", {"request_id": request_id})
        self._dead.pop(request_id, None)
        self._serial += 1
        lease = Lease(request_id, blocks, self.epoch, time.monotonic() + ttl, token or new_lease_token(),
                      digest=b"" if progressive else blocks_digest(blocks, num_tokens), serial=self._serial,
                      commits=CommitLog.opened(blocks, num_tokens) if progressive else None)
        readable = self._readable()
        self._live[request_id] = lease
        self._signal_readable(readable)
        self._holders.hold(blocks, +1)
        self._schedule(lease)
        self.arrivals.arrived(request_id)
        return lease

    @property
    def leased_blocks(self) -> int:
        """Block ids held by live leases (a block in two leases counts twice)."""
        return self._holders.leased_blocks

    def commit(self, request_id: str, epoch: int, *, token: str, commit_epoch: int, block_ids: list[list[int]],
               num_tokens: int = 0, final: bool = False, layers: tuple[int, ...] = ()) -> Lease:
        """Append one chunk's blocks (per group) to a progressive lease at commit_epoch (the
        next one; the last one again with the same blocks is a retry and changes nothing).
        Renews the lease; the final commit fixes the blocks a consumed claim must have read.
        The engine commits only blocks whose KV is computed (layers: in the first layers of
        each group so far, leases/commits.py), and never rewrites what it committed while
        the lease lives (as with any leased block)."""
        lease = self._live_lease(request_id, epoch, token)
        _check_token(lease, token)
        if lease.commits is None:
            raise FailedPrecondition(Reason.LEASE_NOT_PROGRESSIVE, f"request {request_id!r} was leased whole, not "
                                     "opened progressive: it takes no commits", {"request_id": request_id})
        appended = [np.asarray(ids, dtype=np.uint32) for ids in block_ids]
        if not lease.commits.accept(request_id, lease.block_ids, commit_epoch, appended, num_tokens, final, layers):
            return lease  # a retry of a commit made
        self._check_block_quota(appended)
        self._holders.hold(appended, +1)
        lease.block_ids = [np.concatenate((held, more)) for held, more in zip(lease.block_ids, appended, strict=True)]
        lease.commits.record(lease.block_ids, num_tokens, final, layers)
        if final:
            lease.digest = blocks_digest(lease.block_ids, num_tokens)
        self._extend(lease, None)
        self.commit_waits.arrived(request_id)
        return lease

    async def wait_commit(self, request_id: str, epoch: int, *, claim_id: str, d_engine_id: str, after_epoch: int,
                          timeout_s: float, reads_done: bool = False,
                          layers: bool = False) -> tuple[Lease, int, list[tuple[int, int]]]:
        """D, holding claim_id's claim on a progressive lease: the lease, the epoch D sees
        now and, per group, the (start, end) of its block ids committed after after_epoch
        up to that epoch -- at once when there are any (or the lease is final), else once
        the next commit comes or timeout_s passed (then none). layers: D reads chunks
        committed layer by layer; else it sees only commits that left every block whole
        (CommitLog.seen_epoch), and partial commits do not end its wait. Waiting renews the
        lease, as a heartbeat does. A lease released meanwhile answers LEASE_EXPIRED with
        its final state. reads_done: the claimant's READs of what it was handed ended; the
        lease is quiet (no pump needed for it) while every claimant's did and no answer
        handed it more."""
        lease = self._claimed_progressive(request_id, epoch, claim_id)
        assert lease.commits is not None
        if lease.commits.seen_epoch(layers) == after_epoch and not lease.commits.final:
            if reads_done:  # (an answer given at once hands the claimant more to read)
                lease.reads_done.add(claim_id)
                self._requiet(lease)
            end = time.monotonic() + timeout_s
            while True:  # a partial commit wakes a D that does not see it: it waits on
                self._extend(lease, None)
                await self.commit_waits.wait(request_id, d_engine_id, max(0.0, end - time.monotonic()))
                lease = self._claimed_progressive(request_id, epoch, claim_id)
                assert lease.commits is not None
                if (lease.commits.seen_epoch(layers) != after_epoch or lease.commits.final
                        or time.monotonic() >= end):
                    break
        assert lease.commits is not None
        self._extend(lease, None)
        seen = lease.commits.seen_epoch(layers)
        if seen > after_epoch or lease.commits.final:  # D reads what this hands it
            lease.reads_done.discard(claim_id)
            self._requiet(lease)
        return lease, seen, lease.commits.since(after_epoch, seen)

    def _readable(self) -> int:
        """Live leases a D may be reading now (every live lease but the quiet ones)."""
        return len(self._live) - len(self._quiet)

    def _signal_readable(self, before: int) -> None:
        after = self._readable()
        if after and not before:
            self.on_live_change(+1)
        elif before and not after:
            self.on_live_change(-1)

    def _requiet(self, lease: Lease) -> None:
        """A progressive lease is quiet while it has claims and every one of them said its
        READs ended since it was last handed blocks; a new claim makes it readable again."""
        quiet = lease.commits is not None and bool(lease.claims) and lease.claims.keys() <= lease.reads_done
        rid = lease.request_id
        if rid not in self._live or quiet == (rid in self._quiet):
            return
        before = self._readable()
        if quiet:
            self._quiet.add(rid)
        else:
            self._quiet.discard(rid)
        self._signal_readable(before)

    def _claimed_progressive(self, request_id: str, epoch: int, claim_id: str) -> Lease:
        lease = self._live_lease(request_id, epoch)
        if claim_id not in lease.claims:
            raise PermissionDenied(Reason.LEASE_NOT_OWNER, f"request {request_id!r} is not claimed by this claim: "
                                   "claim it before waiting for its commits", {"request_id": request_id})
        if lease.commits is None:
            raise FailedPrecondition(Reason.LEASE_NOT_PROGRESSIVE, f"request {request_id!r} was leased whole: it has "
                                     "no commits to wait for", {"request_id": request_id})
        return lease

    def claim(self, request_id: str, epoch: int, *, token: str, claim_id: str, d_engine_id: str, d_tp_size: int,
              d_ranks: Sequence[int] = (), extend_s: float | None = None, d_dcp_size: int = 1,
              consumed: bool = False, digest: bytes = b"", serial: int = 0) -> Lease | None:
        """Grant (or repeat) claim_id's claim on d_ranks (empty: all D ranks); extends the lease.
        None: a claim-and-consumed that this claim_id already made (the lease is released
        CONSUMED; a retry after a lost answer gets the same answer, never LEASE_EXPIRED).

        A lease has one owner per D rank: another claim_id for overlapping ranks, or any
        claim from another D engine, is refused with LEASE_CLAIMED. consumed: the claimant
        read before claiming; its ranks are reported consumed in the same step (the lease is
        released once every D rank it waits for has been), so the grant itself is the proof
        that the lease was never released while they read. digest (blocks_digest of the
        params read by): refused with PARAMS_INCONSISTENT when the lease holds other blocks.
        serial (the lease's, as its params say; 0: unchecked): a later lease of the same id
        (and token, where an engine derives tokens from ids) is refused with LEASE_EXPIRED.
        """
        live = self._live.get(request_id) if epoch == self.epoch else None
        if live is not None and live.commits is not None and digest and not consumed:
            # An early claim with a digest reads the lease whole, and a D whose claim of a
            # whole lease holds answers before P confirms (transfer_run._confirm). A
            # progressive lease is read by its commits, and its engine may take it back while
            # claimed (withdraw): only P's confirm can prove such a read.
            _check_token(live, token)
            raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"request {request_id!r} was leased progressively but "
                                  "the params read it whole: use the params of its lease, unedited "
                                  "(TransferParams.progressive)", {"request_id": request_id, "progressive": "true"})
        growing = live if consumed else None
        if growing is not None and growing.commits is not None and not growing.commits.final:
            _check_token(growing, token)  # refused before any claim is granted: the answer changes nothing
            raise FailedPrecondition(Reason.LEASE_NOT_FINAL, f"request {request_id!r} is still growing (commit "
                                     f"epoch {growing.commits.epoch}): it is consumed only once read after its "
                                     "final commit", {"request_id": request_id,
                                                      "lease_commit_epoch": growing.commits.epoch})
        try:
            lease = self._grant(request_id, epoch, token=token, claim_id=claim_id, d_engine_id=d_engine_id,
                                d_tp_size=d_tp_size, d_ranks=d_ranks, extend_s=extend_s, d_dcp_size=d_dcp_size,
                                digest=digest, serial=serial)
        except FailedPrecondition as e:
            if consumed and e.reason == Reason.LEASE_EXPIRED and self.consumed_by(request_id, epoch, claim_id):
                return None  # this claim consumed it already: a retry, answered as the first was
            raise
        if consumed:
            assert lease.tracker is not None
            lease.tracker.notify(sorted(lease.claims[claim_id].d_ranks))
            if lease.tracker.done:  # claimed and consumed in one step: its READs are over
                self._release(lease, LeaseState.CONSUMED)
        return lease

    def _grant(self, request_id: str, epoch: int, *, token: str, claim_id: str, d_engine_id: str, d_tp_size: int,
               d_ranks: Sequence[int], extend_s: float | None, d_dcp_size: int, digest: bytes,
               serial: int = 0) -> Lease:
        lease = self._live_lease(request_id, epoch, token)
        if serial and serial != lease.serial:
            # The params' lease was released and the id leased again (SGLang's bootstrap room
            # reused): its READs may have read the new lease's blocks before it was published.
            raise FailedPrecondition(Reason.LEASE_EXPIRED, f"request {request_id!r} holds a later lease than the params "
                                     "were issued for (theirs was released)",
                                     {"request_id": request_id, "state": "replaced"})
        _check_token(lease, token)
        if digest and lease.complete and not secrets.compare_digest(digest, lease.digest):
            raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"the params' block ids or num_tokens are not those "
                                  f"request {request_id!r} was published with: use the params PublishBlocks "
                                  "returned for it, unedited", {"request_id": request_id})
        tp_ratio(d_tp_size, self.tp_size)  # TP_NOT_DIVISIBLE before any accounting
        ranks = frozenset(d_ranks) if d_ranks else frozenset(range(d_tp_size))
        bad = sorted(r for r in ranks if not 0 <= r < d_tp_size)
        if bad:
            raise InvalidArgument(Reason.RANK_OUT_OF_RANGE, f"ranks {bad[:8]} are outside the D TP size {d_tp_size}",
                                  {"ranks": ",".join(map(str, bad[:8])), "tp_size": d_tp_size})
        if lease.state is LeaseState.CLAIMED and (lease.d_engine_id, lease.d_tp_size, lease.d_dcp_size) != (
                d_engine_id, d_tp_size, d_dcp_size):
            raise FailedPrecondition(Reason.LEASE_CLAIMED, f"request {request_id!r} is claimed by engine "
                                     f"{lease.d_engine_id!r} (TP {lease.d_tp_size})",
                                     {"request_id": request_id, "claimed_by": lease.d_engine_id})
        if lease.state is LeaseState.OFFERED and self._claims_of.get(d_engine_id, 0) >= self.max_claims_per_engine:
            # One D engine may not hold every lease (a claim extends it, heartbeats keep it):
            # the rest of the table stays for the engine's other readers.
            raise KvsvcError(Reason.TOO_MANY_CLAIMS, f"engine {d_engine_id[:64]!r} holds {self.max_claims_per_engine} "
                             "claimed leases here, the most one D engine may; finish or abort some first",
                             {"engine_id": d_engine_id, "max_claims_per_engine": self.max_claims_per_engine},
                             code=ErrorCode.RESOURCE_EXHAUSTED)
        held = lease.claims.get(claim_id)
        if held is not None:
            if held.d_ranks != ranks:
                raise InvalidArgument(Reason.CLAIM_CONFLICT, f"claim {claim_id[:8]}... was made for other ranks",
                                      {"request_id": request_id})
        else:
            taken = sorted(set().union(*(c.d_ranks & ranks for c in lease.claims.values())))
            if taken:
                raise FailedPrecondition(Reason.LEASE_CLAIMED, f"D ranks {taken[:8]} of request {request_id!r} are "
                                         "claimed by another transfer", {"request_id": request_id,
                                                                         "ranks": ",".join(map(str, taken[:8]))})
            lease.claims[claim_id] = Claim(claim_id, ranks)
            self._requiet(lease)  # a new claimant may read at once
        if lease.state is LeaseState.OFFERED:
            lease.state = LeaseState.CLAIMED
            lease.d_engine_id, lease.d_tp_size, lease.d_dcp_size = d_engine_id, d_tp_size, d_dcp_size
            lease.tracker = ReleaseTracker(self.hosted_ranks, d_tp_size, self.tp_size, d_dcp_size, self.dcp_size)
            self._claimed += 1
            self._claims_of[d_engine_id] = self._claims_of.get(d_engine_id, 0) + 1
            self._no_claims.clear()
        self._extend(lease, extend_s)
        return lease

    def notify(self, request_id: str, kind: NotifyKind, d_ranks: Sequence[int], epoch: int, *,
               token: str = "", claim_id: str = "", withdraw: bool = False,
               even_final: bool = False) -> tuple[LeaseState | None, list[int]]:
        """Apply a notification; (state after, D ranks still pending). Idempotent.

        A claimed lease hears only from its owners (claim_id), and CONSUMED only for the
        owner's ranks; an unclaimed lease may be aborted or heartbeated by whoever holds
        its token. A released or unknown lease answers its final state and changes nothing.
        """
        if epoch != self.epoch:
            return LeaseState.EXPIRED, []
        lease = self._live.get(request_id)
        if lease is None:
            dead = self._dead.get(request_id)
            if dead is None and kind is NotifyKind.ABORTED and token and not withdraw:
                self._remember(self._aborted_early, request_id, token)
                self.arrivals.arrived(request_id)  # a claim waiting for it is refused now
            return (dead.state if dead else None), []
        claim = lease.claims.get(claim_id) if claim_id else None
        if withdraw and lease.commits is not None and (even_final or not lease.commits.final):
            # The engine ends its own growing lease (the request was aborted before its last
            # chunk, or -- even_final -- the engine freed its blocks, preempted), claimed or
            # not: D's waits hear LEASE_EXPIRED and its confirm is refused, so what it read is
            # never used (as when a lease expires under its READs).
            _check_token(lease, token)
        elif claim is None or withdraw:
            self._check_unclaimed_access(lease, kind, token)
        if withdraw:
            if kind is not NotifyKind.ABORTED:
                raise InvalidArgument(Reason.INVALID_FIELD, "withdraw goes with NOTIFY_KIND_ABORTED", {"field": "withdraw"})
            self._release(lease, LeaseState.ABORTED, announce=False)
            return lease.state, []
        if kind is NotifyKind.HEARTBEAT:
            self._extend(lease, None)
            return lease.state, lease.tracker.pending_d_ranks if lease.tracker else []
        if kind is NotifyKind.ABORTED:
            self._release(lease, LeaseState.ABORTED)
            return lease.state, []
        assert claim is not None and lease.tracker is not None  # CONSUMED needs a claim (checked above)
        if not lease.complete:
            raise FailedPrecondition(Reason.LEASE_NOT_FINAL, f"request {request_id!r} is still growing: it is "
                                     "consumed only once read after its final commit", {"request_id": request_id})
        bad = sorted(set(d_ranks) - claim.d_ranks)
        if bad:
            raise InvalidArgument(Reason.RANK_NOT_CLAIMED, f"done_ranks {bad[:8]} are not ranks this claim holds",
                                  {"ranks": ",".join(map(str, bad[:8]))})
        lease.tracker.notify(d_ranks)
        if lease.tracker.done:
            self._release(lease, LeaseState.CONSUMED)
        return lease.state, lease.tracker.pending_d_ranks

    def _check_unclaimed_access(self, lease: Lease, kind: NotifyKind, token: str) -> None:
        if lease.claims:
            raise PermissionDenied(Reason.LEASE_NOT_OWNER, f"request {lease.request_id!r} is claimed; only its claimant "
                                   "(claim_id) may notify", {"request_id": lease.request_id})
        if kind is NotifyKind.CONSUMED:
            raise FailedPrecondition(Reason.LEASE_NOT_CLAIMED, f"request {lease.request_id!r} was never claimed: claim "
                                     "it before reading", {"request_id": lease.request_id})
        _check_token(lease, token)

    def refuse(self, request_id: str, token: str) -> None:
        """The engine could not lease request_id (its publish under `token` failed): claims
        that wait for the lease (params with lease_pending) find an ABORTED tombstone and
        fail now. A live lease of that id (someone else's token) is left alone."""
        self._aborted_early.pop(request_id, None)
        if request_id not in self._live:
            self._remember(self._dead, request_id, Tombstone(LeaseState.ABORTED, unix_ms()))
            self.arrivals.arrived(request_id)

    @staticmethod
    def _remember(history: OrderedDict[str, Any], request_id: str, value: Any) -> None:
        history[request_id] = value
        history.move_to_end(request_id)
        while len(history) > TOMBSTONES_MAX:
            history.popitem(last=False)

    def get(self, request_id: str) -> Lease | None:
        """The live lease of request_id, if any."""
        return self._live.get(request_id)

    def consumed_by(self, request_id: str, epoch: int, claim_id: str) -> bool:
        """Whether claim_id's claim consumed request_id's lease (of this epoch), per its tombstone."""
        dead = self._dead.get(request_id)
        return (epoch == self.epoch and dead is not None and dead.state is LeaseState.CONSUMED
                and claim_digest(claim_id) in dead.consumed_by)

    def final_state(self, request_id: str) -> LeaseState | None:
        """How request_id's lease ended, while its tombstone is kept; None while it is live
        or when nothing is known of it (never leased, or forgotten long ago)."""
        dead = self._dead.get(request_id)
        return dead.state if dead is not None and request_id not in self._live else None


    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def claimed_count(self) -> int:
        return self._claimed

    def listing(self, limit: int, prefix: str = "") -> list[Lease]:
        """Live leases, soonest to expire first, at most limit; reads only (nothing is extended,
        and one past its deadline that the reaper has not reached yet is left out)."""
        now = time.monotonic()
        alive = (lease for lease in self._live.values()
                 if lease.request_id.startswith(prefix) and lease.expires_at > now)
        return heapq.nsmallest(limit, alive, key=lambda lease: lease.expires_at)

    def lookup(self, request_ids: Iterable[str]) -> list[Lease]:
        """The live leases of exactly these request ids (a reader that missed releases asks
        which are still held), in the order asked; reads only, like listing()."""
        now = time.monotonic()
        found = (self._live.get(rid) for rid in dict.fromkeys(request_ids))
        return [lease for lease in found if lease is not None and lease.expires_at > now]

    def subscribe(self) -> Subscription:
        """Releases from this moment on (registered before this returns), until close(), or
        until the subscriber falls watch_backlog_bytes behind (then SubscriberBehind)."""
        sub = Subscription(self._watchers, self.watch_backlog_bytes)
        self._watchers.add(sub)
        return sub

    # ---- internals ------------------------------------------------------------------

    def _live_lease(self, request_id: str, epoch: int, token: str = "") -> Lease:
        if epoch != self.epoch:
            raise FailedPrecondition(Reason.LEASE_EXPIRED, f"lease epoch {epoch} is not this server's epoch {self.epoch} "
                                     "(the prefill server restarted); re-publish the request",
                                     {"request_id": request_id, "lease_epoch": epoch, "server_epoch": self.epoch})
        lease = self._live.get(request_id)
        if lease is not None and lease.expires_at <= time.monotonic():
            self._grace_after_stall(time.monotonic())  # a call read first after a stall: see LOOP_STALL_S
            if lease.expires_at <= time.monotonic():
                self._release(lease, LeaseState.EXPIRED)
                lease = None
        if lease is None:
            dead = self._dead.get(request_id)
            state = dead.state.value if dead else "unknown"
            if dead is None and token and self._aborted_early.get(request_id) == token:
                state = LeaseState.ABORTED.value  # given up before it was made: it never will be
            raise FailedPrecondition(Reason.LEASE_EXPIRED, f"request {request_id!r} holds no live lease ({state})",
                                     {"request_id": request_id, "state": state})
        return lease

    def _check_block_quota(self, blocks: list[np.ndarray]) -> None:
        """Refuse block ids past max_leased_blocks across live leases (4 bytes each, and more)."""
        count = sum(int(a.size) for a in blocks)
        if self._holders.leased_blocks + count > self.max_leased_blocks:
            raise KvsvcError(Reason.TOO_MANY_LEASED_BLOCKS, f"{self._holders.leased_blocks} block ids are leased, and {count} "
                             f"more would pass the most this server keeps ({self.max_leased_blocks}); wait for "
                             "releases", {"leased_blocks": self._holders.leased_blocks, "asked": count,
                                          "max_leased_blocks": self.max_leased_blocks},
                             code=ErrorCode.RESOURCE_EXHAUSTED)

    def _extend(self, lease: Lease, extend_s: float | None) -> None:
        if self._held_to_deadlines:  # a drain ran out: claims end at the deadlines D was told
            return
        ttl = min(extend_s or self.default_ttl_s, self.max_ttl_s)
        lease.expires_at = max(lease.expires_at, time.monotonic() + ttl)
        self._graced.discard(lease.request_id)
        self._schedule(lease)

    def _schedule(self, lease: Lease) -> None:
        entry = (lease.expires_at, lease.request_id)
        heapq.heappush(self._heap, entry)
        if self._heap[0] is entry:  # due before the reaper's next wake-up: wake it (else it
            self._wake.set()        # sleeps on; two wake-ups a transfer were ~10 % of P's CPU)

    def _release(self, lease: Lease, reason: LeaseState, announce: bool = True) -> None:
        if lease.state.released:
            return
        self._graced.discard(lease.request_id)
        if lease.state is LeaseState.CLAIMED:
            self._claimed -= 1
            left = self._claims_of.pop(lease.d_engine_id, 1) - 1
            if left:
                self._claims_of[lease.d_engine_id] = left
            if not self._claimed:
                self._no_claims.set()
        lease.state = reason
        lease.released_unix_ms = unix_ms()
        readable = self._readable()
        if self._live.pop(lease.request_id, None) is not None:
            self._quiet.discard(lease.request_id)
            self._signal_readable(readable)
        self._holders.hold(lease.block_ids, -1)
        self.commit_waits.arrived(lease.request_id)  # a D waiting for its next commit hears it ended
        # A tombstone keeps the final state only: block lists of released leases would
        # otherwise pile up (a 100k-entry history of long requests is gigabytes).
        consumed_by = tuple(claim_digest(c) for c in lease.claims) if reason is LeaseState.CONSUMED else ()
        self._remember(self._dead, lease.request_id, Tombstone(reason, lease.released_unix_ms, consumed_by))
        log.info("released %s: %s%s", lease.request_id, reason.value, "" if announce else " (withdrawn)")
        if not announce:  # never handed out: the engine hears of it from its failed publish
            return
        self.on_release(reason)
        if not self._watchers:
            return
        ev = Release(lease.request_id, reason, lease.block_ids, lease.released_unix_ms,
                     self._holders.now_free(lease.block_ids))
        for w in list(self._watchers):
            w.offer(ev)

    def expire_due(self) -> None:
        now = time.monotonic()
        self._grace_after_stall(now)
        while self._heap and self._heap[0][0] <= now:
            _, rid = heapq.heappop(self._heap)
            lease = self._live.get(rid)
            # Stale heap entries (deadline moved later, or already released) are skipped.
            if lease is not None and lease.expires_at <= now:
                self._release(lease, LeaseState.EXPIRED)

    def _grace_after_stall(self, now: float) -> None:
        """If the reaper is LOOP_STALL_S past the wake-up it planned, the loop was stalled:
        every lease due by now gets as long again as the reaper is late (at most
        MAX_STALL_GRACE_S), once per stall and once per renewal (a loop late all the time
        does not keep a lease nobody renews)."""
        planned = self._planned
        if planned is None or now - planned <= LOOP_STALL_S or self._held_to_deadlines:
            return
        self._planned = None
        grace = min(now - planned, MAX_STALL_GRACE_S)
        due = [lease for lease in self._live.values() if lease.expires_at <= now and lease.request_id not in self._graced]
        for lease in due:
            self._graced.add(lease.request_id)
            lease.expires_at = now + grace
            heapq.heappush(self._heap, (lease.expires_at, lease.request_id))
        if due:
            log.warning("lease expiry ran %.1f s late (this server's event loop was stalled): %d leases that fell due "
                        "meanwhile get %.1f s more, for the renewals sent to them meanwhile", now - planned, len(due),
                        grace)

    async def _reap(self) -> None:
        while True:
            self.expire_due()
            self._wake.clear()
            self._planned = self._heap[0][0] if self._heap else None
            timeout = max(0.0, self._heap[0][0] - time.monotonic()) if self._heap else None
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for swallows a cancel that
            # arrives as the wake-up event is set, and close() then waited forever.
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass


