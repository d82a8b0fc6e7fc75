"""D's view of a P engine that may span several servers, and the lease conversation with each.

Which server holds which P ranks, which hosted D ranks need each one (one leg per
server), and the RPCs that make a leg's claim: claim, heartbeat, confirm, abort.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvsvc.codec import bad_field
from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError, lease_not_yet_made
from kvsvc.limits import MAX_ADDRESS_BYTES, MAX_TP_SIZE, check_count, check_id
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.reasons import Reason
from kvsvc.service.peers import Peer
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")

# Claim outcomes that leave P's lease state unknown (the claim may have been granted).
UNKNOWN_OUTCOME = (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED, ErrorCode.INTERNAL)

HEARTBEAT_MIN_INTERVAL_S = 0.05
# LeaseClock.held_until stays this far inside P's deadline: the two hosts' clocks may run
# at slightly different rates (parts per million: microseconds over a lease's seconds).
HELD_MARGIN_S = 0.02

# A claim for params with lease_pending that finds no lease yet waits on P for it
# (ClaimLeaseRequest.wait_ms; P's workers lease the blocks in the step that finishes the
# request or the next) for at most this long, and never past its own timeout: the wait
# ends this margin before the call's deadline, so P's answer arrives inside it.
PENDING_LEASE_WAIT_S = 30.0
PENDING_WAIT_MARGIN_S = 0.1
# A P server that answers "not made" before the wait is over (an older one, or one that
# holds too many waiting claims) is asked again, from every 5 ms to every 100 ms.
PENDING_RETRY_FIRST_S = 0.005
PENDING_RETRY_MAX_S = 0.1


@dataclass(frozen=True, slots=True)
class ServerRef:
    """One P server as the params name it; ranks None: it hosts every rank (one-server engine)."""

    address: str
    epoch: int
    ranks: frozenset[int] | None


def p_servers(p: pb.TransferParams) -> list[ServerRef]:
    if not p.remote_servers:
        return [ServerRef(p.remote_address, p.remote_epoch, None)]
    if not p.remote_tp_size:
        raise bad_field("params.remote_tp_size", "must be set when params.remote_servers is", Reason.MISSING_FIELD)
    check_count(p.remote_servers, "params.remote_servers", MAX_TP_SIZE)
    out = []
    for i, s in enumerate(p.remote_servers):
        check_id(s.address, f"params.remote_servers[{i}].address", MAX_ADDRESS_BYTES)
        if s.address == p.remote_address and s.epoch != p.remote_epoch:
            # Params edited by hand or stitched from two publishes: trust neither epoch.
            raise bad_field(f"params.remote_servers[{i}].epoch", f"{s.epoch} contradicts params.remote_epoch "
                            f"{p.remote_epoch} for the same server", Reason.PARAMS_INCONSISTENT)
        out.append(ServerRef(s.address, s.epoch, frozenset(s.ranks)))
    return out


def servers_needed(servers: Sequence[ServerRef], hosted: Sequence[int], d_tp: int,
                   p_tp: int, d_dcp: int = 1, p_dcp: int = 1) -> list[tuple[ServerRef, list[int]]]:
    """Each server holding a P rank that some hosted D rank reads or notifies, with those D ranks.

    PEER_RANKS_MISSING when a needed P rank is on none of the servers.
    """
    if len(servers) == 1 and servers[0].ranks is None:
        return [(servers[0], list(hosted))]
    targets = {t: set(handshake_target_ranks(t, d_tp, p_tp, d_dcp, p_dcp)) for t in hosted}
    wanted = set().union(*targets.values())
    out, covered = [], set()
    for s in servers:
        mine = s.ranks or frozenset()
        d_ranks = [t for t in hosted if targets[t] & mine]
        covered |= wanted & mine
        if d_ranks:
            out.append((s, d_ranks))
    missing = sorted(wanted - covered)
    if missing:
        raise FailedPrecondition(Reason.PEER_RANKS_MISSING, f"prefill ranks {missing[:8]} are on none of the servers the "
                                 "params name", {"ranks": ",".join(map(str, missing[:8]))})
    return out


async def settled(aws: Sequence[Awaitable[T]]) -> list[T | BaseException]:
    """Each awaitable's result or error, as asyncio.gather(..., return_exceptions=True) gives
    them (a cancellation of the caller still cancels), without a task for the single one of
    a one-server P engine: the common case, on every transfer's path."""
    if len(aws) == 1:
        try:
            return [await aws[0]]
        except Exception as e:
            return [e]
    return await asyncio.gather(*aws, return_exceptions=True)


class ClaimState(enum.Enum):
    NOT_SENT = "not sent"
    SENT = "sent"  # outcome unknown (lost, cancelled): treat as held when cleaning up
    HELD = "held"
    REFUSED = "refused"  # P answered no: nothing of ours to abort there
    # P had not made the lease when we gave up waiting: it is told ABORTED with the token,
    # so that the lease, made later, is refused at once instead of held to its TTL.
    NOT_MADE = "not made"


class LeaseClock:
    """D's view of P's lease deadline, in local monotonic time (no clock skew between hosts).

    deadline: from when P's answer was read here (what heartbeats are paced by). held_until:
    from when the call it answers was sent, less HELD_MARGIN_S -- P counted its remaining
    time after that, so P holds the lease at least this long: a bound that a late answer
    (a slow link, this loop stalled before reading it) cannot push past P's real deadline.
    """

    def __init__(self, remaining_ms: int, sent_at: float | None = None) -> None:
        self.held_until = float("-inf")
        self.renew(remaining_ms, sent_at)

    def renew(self, remaining_ms: int, sent_at: float | None = None) -> None:
        self.deadline = time.monotonic() + remaining_ms / 1000
        if sent_at is not None:
            self.held_until = max(self.held_until, sent_at + remaining_ms / 1000 - HELD_MARGIN_S)

    @property
    def holds(self) -> bool:
        """P holds the lease now, for certain (see held_until)."""
        return time.monotonic() < self.held_until

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline


@dataclass
class Leg:
    """The part of a transfer served by one P server."""

    peer: Peer
    d_ranks: list[int]
    claim: ClaimState = ClaimState.NOT_SENT
    clock: LeaseClock | None = None
    content: list[pb.BlockContent] = field(default_factory=list)  # P's digests of its blocks, where asked for

    @property
    def may_hold(self) -> bool:
        """Whether P may hold a claim of ours here (so an abort is owed)."""
        return self.claim in (ClaimState.SENT, ClaimState.HELD)


class ClaimRefused(Exception):
    """Every P server that answered refused the claim (no lease of ours to abort); carries P's error."""

    def __init__(self, error: KvsvcError) -> None:
        super().__init__(str(error))
        self.error = error


def _lease_serial(p: pb.TransferParams, address: str) -> int:
    """The serial of the lease the params name on the server at address (0: not given)."""
    return next((s.lease_serial for s in p.remote_servers if s.address == address), 0)


@dataclass(frozen=True, slots=True)
class Ownership:
    """Who a transfer is to P: the D engine, and the claim_id that owns the lease."""

    params: pb.TransferParams
    engine_id: str
    tp_size: int
    claim_id: str
    dcp_size: int = 1
    traceparent: str = ""  # the transfer's trace context, passed with every lease call
    blocks_digest: bytes = b""  # of the params' blocks: P refuses a claim for other blocks than its lease's
    want_content: bool = False  # ask P for its blocks' content digests (content_digest)

    def notify(self, kind: pb.NotifyKind, epoch: int, done_ranks: list[int] | None = None) -> pb.NotifyRequest:
        """A notification to the P server of epoch `epoch` (each server of an engine has its own)."""
        p = self.params
        return pb.NotifyRequest(request_id=p.remote_request_id, kind=kind, engine_id=self.engine_id,
                                tp_size=self.tp_size, done_ranks=done_ranks or [], lease_epoch=epoch,
                                lease_token=p.lease_token, claim_id=self.claim_id)


def _claim_request(leg: Leg, own: Ownership, consumed: bool) -> pb.ClaimLeaseRequest:
    p = own.params
    return pb.ClaimLeaseRequest(
        request_id=p.remote_request_id, lease_epoch=leg.peer.epoch, engine_id=own.engine_id,
        tp_size=own.tp_size, lease_token=p.lease_token, claim_id=own.claim_id, ranks=leg.d_ranks,
        dcp_size=own.dcp_size, consumed=consumed, blocks_digest=own.blocks_digest,
        lease_serial=_lease_serial(p, leg.peer.address), want_content=own.want_content)


async def claim_all(legs: list[Leg], own: Ownership, timeout_s: float, consumed: bool = False) -> None:
    """Claim at every P server at once; raise if any claim did not hold (ClaimRefused when
    every server that answered said no, so there is nothing of ours to abort).

    consumed: the READs are done; each grant also reports this leg's ranks consumed, and
    is the proof that P held the blocks, unreleased, from publish until after they were read.
    """
    async def claim(leg: Leg) -> None:
        p = own.params
        req = _claim_request(leg, own, consumed)
        first_try = time.monotonic()
        deadline = first_try + timeout_s  # one for every try: waiting for a lease adds no time
        give_up_at = first_try + (min(timeout_s, PENDING_LEASE_WAIT_S) if p.lease_pending else 0.0)
        pause = PENDING_RETRY_FIRST_S
        while True:
            leg.claim = ClaimState.SENT
            sent = time.monotonic()
            req.wait_ms = int(1000 * max(0.0, give_up_at - sent - PENDING_WAIT_MARGIN_S))
            try:
                resp = await leg.peer.lease_calls.claim_lease(
                    req, timeout_s=max(0.05, deadline - sent), traceparent=own.traceparent)
                if time.monotonic() - first_try > 0.08:  # say how long P took to make its lease
                    log.info("claim of %s waited %.0f ms for %s to make its lease", p.remote_request_id,
                             1e3 * (time.monotonic() - first_try), leg.peer.address)
                break
            except KvsvcError as e:
                # Params handed out before P leased the blocks: P held the claim until the
                # lease was made or the wait was over. One answered sooner is asked again.
                if e.reason == Reason.TOO_MANY_WAITING_CLAIMS:
                    leg.claim = ClaimState.NOT_MADE  # given up on, as a lease that did not come
                if not lease_not_yet_made(e):
                    raise
                if time.monotonic() + pause + PENDING_WAIT_MARGIN_S > give_up_at:
                    if p.lease_pending:  # given up on; without lease_pending it is long gone
                        leg.claim = ClaimState.NOT_MADE
                    raise
            leg.claim = ClaimState.REFUSED
            await asyncio.sleep(pause)
            pause = min(2 * pause, PENDING_RETRY_MAX_S)
        leg.claim, leg.clock = ClaimState.HELD, LeaseClock(resp.lease_remaining_ms, sent)
        leg.content = list(resp.content)
        if consumed and resp.state == pb.LEASE_STATE_UNSPECIFIED:
            # A P server older than `consumed` took it as a plain claim: the grant proves the
            # bytes all the same (the lease was live), but P's blocks wait for a CONSUMED.
            await confirm_all([leg], own, timeout_s)

    outcomes = await settled([claim(leg) for leg in legs])
    errors = []
    for leg, out in zip(legs, outcomes, strict=True):
        if isinstance(out, KvsvcError) and out.code not in UNKNOWN_OUTCOME and leg.claim is not ClaimState.NOT_MADE:
            leg.claim = ClaimState.REFUSED  # P answered no: nothing of ours to abort
        if isinstance(out, BaseException):
            errors.append(out)
    if errors:
        refused = [e for e in errors if isinstance(e, KvsvcError) and e.code not in UNKNOWN_OUTCOME]
        if len(refused) == len(errors) and not any(leg.may_hold for leg in legs):
            raise ClaimRefused(refused[0])
        raise next((e for e in errors if e not in refused), errors[0])


async def confirm_all(legs: list[Leg], own: Ownership, timeout_s: float) -> None:
    """CONSUMED at every P server; each must still know our claim (the proof the bytes are good)."""
    answers = await asyncio.gather(*(
        leg.peer.lease_calls.notify(own.notify(pb.NOTIFY_KIND_CONSUMED, leg.peer.epoch, leg.d_ranks), timeout_s=timeout_s,
                                    traceparent=own.traceparent)
        for leg in legs))
    for leg, resp in zip(legs, answers, strict=True):
        if resp.state not in (pb.LEASE_STATE_CONSUMED, pb.LEASE_STATE_CLAIMED):
            raise FailedPrecondition(Reason.LEASE_EXPIRED, f"the prefill server {leg.peer.address} released the blocks "
                                     f"({pb.LeaseState.Name(resp.state)}) before the reads were confirmed",
                                     {"request_id": own.params.remote_request_id,
                                      "state": pb.LeaseState.Name(resp.state), "address": leg.peer.address})


async def heartbeat(leg: Leg, own: Ownership, claimed: asyncio.Future[None] | None = None) -> None:
    """Keep one P server's lease alive while long reads run: HEARTBEAT at a third of the time left
    (once the claim, which may still be on its way, was granted)."""
    if claimed is not None:
        await asyncio.wait([claimed])
    clock = leg.clock
    if clock is None or leg.claim is not ClaimState.HELD:
        return
    while True:
        await asyncio.sleep(max(HEARTBEAT_MIN_INTERVAL_S, clock.remaining_s / 3))
        sent = time.monotonic()
        try:
            resp = await leg.peer.lease_calls.notify(own.notify(pb.NOTIFY_KIND_HEARTBEAT, leg.peer.epoch),
                                                     traceparent=own.traceparent)
        except KvsvcError:
            log.warning("heartbeat for %s at %s failed", own.params.remote_request_id, leg.peer.address)
            continue
        if resp.state not in (pb.LEASE_STATE_CLAIMED, pb.LEASE_STATE_OFFERED):
            return  # released meanwhile: the final notify will say so
        clock.renew(resp.lease_remaining_ms, sent)


async def abort_all(legs: list[Leg], own: Ownership, timeout_s: float) -> tuple[bool, list[str]]:
    """ABORTED to every P server that did not refuse us; (all of them told, addresses that did not answer).

    One that holds our claim must hear it, and an unclaimed lease of a request we gave up
    on is freed with the token (a lease another transfer owns answers LEASE_NOT_OWNER and
    stays as it is). Never cancelled halfway: P must not keep a lease nobody will read.
    """
    async def abort(leg: Leg) -> str:
        try:
            await leg.peer.lease_calls.notify(own.notify(pb.NOTIFY_KIND_ABORTED, leg.peer.epoch), timeout_s=timeout_s,
                                              traceparent=own.traceparent)
            return "told"
        except KvsvcError as e:
            log.warning("could not tell %s that %s was aborted", leg.peer.address, own.params.remote_request_id)
            return "gone" if e.code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED) else "refused"

    owed = [leg for leg in legs if leg.claim is not ClaimState.REFUSED]
    try:
        told = await asyncio.shield(asyncio.gather(*(abort(leg) for leg in owed)))
    except asyncio.CancelledError:
        told = ["unknown"] * len(owed)
    gone = [leg.peer.address for leg, t in zip(owed, told, strict=True) if t == "gone"]
    return all(t == "told" for t in told), gone
