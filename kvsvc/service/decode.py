"""The D side: one Transfer = plan + claim + NIXL READs on every hosted rank + await + Notify."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from kvsvc.client import AsyncClient
from kvsvc.codec import bad_field, block_ids_from_proto
from kvsvc.config import Role
from kvsvc.errors import (
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    KvsvcError,
    Unavailable,
)
from kvsvc.mapping.planner import RankPlan
from kvsvc.service.node import Node
from kvsvc.service.peers import Peer, PeerCache, RemoteRank, peer_client_options
from kvsvc.transport.nixl_thread import InFlight
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# How long a cancelled or failed transfer waits for posted READs to settle before it
# answers: D's blocks must not be written after the caller was told they are invalid.
DRAIN_TIMEOUT_S = 10.0


# Claim outcomes that leave P's lease state unknown (the claim may have been granted).
UNKNOWN_OUTCOME = (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED, ErrorCode.INTERNAL)


HEARTBEAT_MIN_INTERVAL_S = 0.05


class LeaseClock:
    """D's view of P's lease deadline, in local monotonic time (no clock skew between hosts)."""

    def __init__(self, remaining_ms: int) -> None:
        self.renew(remaining_ms)

    def renew(self, remaining_ms: int) -> None:
        self.deadline = time.monotonic() + remaining_ms / 1000

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline


class ClaimRefused(Exception):
    """P refused the claim (its lease is not ours to abort); carries P's error."""

    def __init__(self, error: KvsvcError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Posted:
    rank: int
    flight: InFlight
    nbytes: int
    descriptors: int


def _addresses(node: Node, peer: Peer, plan: RankPlan) -> list[tuple[RemoteRank, np.ndarray, np.ndarray, np.ndarray]]:
    """(remote rank, local addresses, remote addresses, lengths) per source rank."""
    pool = node.pools[plan.local_rank]
    local_base = np.array([pool.base_address + r.pool_offset for r in node.side.pool.regions], dtype=np.int64)
    out = []
    for reads in plan.reads:
        if not reads.num_descriptors:
            continue
        rr = peer.ranks.get(reads.remote_rank)
        if rr is None:
            raise FailedPrecondition("PEER_RANKS_MISSING", f"prefill rank {reads.remote_rank} was not in the "
                                     "handshake", {"rank": reads.remote_rank})
        remote_base = np.asarray(rr.region_bases, dtype=np.int64)
        out.append((rr, local_base[reads.local_region] + reads.local_offset,
                    remote_base[reads.remote_region] + reads.remote_offset, reads.length))
    return out


class Decoder:
    """Runs Transfer RPCs for the D ranks this server hosts."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.peers = PeerCache(node)

    async def close(self) -> None:
        await self.peers.close()

    async def transfer(self, req: pb.TransferRequest, time_remaining_s: float | None) -> pb.TransferResponse:
        node = self.node
        node.require_role(Role.DECODE, "Transfer")
        data = node.require_data_plane("Transfer")
        started = time.perf_counter()
        p = req.params
        for name in ("remote_address", "remote_request_id"):
            if not getattr(p, name):
                raise bad_field(f"params.{name}", "must be set (copy TransferParams from PublishBlocks)", "MISSING_FIELD")
        if p.remote_epoch == 0:
            raise bad_field("params.remote_epoch", "must be set (copy TransferParams from PublishBlocks)", "MISSING_FIELD")
        local_ids = block_ids_from_proto(req.local_block_ids_per_group)
        remote_ids = block_ids_from_proto(p.remote_block_ids_per_group)
        try:
            peer = await self.peers.get(p.remote_address, p.remote_engine_id, p.remote_epoch)
        except FailedPrecondition as e:
            if e.reason not in ("LEASE_EXPIRED", "UNKNOWN_ENGINE"):  # refused pair: free P's blocks now
                await self._abort_unpaired(p)
            raise
        if p.remote_tp_size and p.remote_tp_size != peer.tp_size:
            raise InvalidArgument("TP_MISMATCH", f"params say remote TP {p.remote_tp_size} but {p.remote_address} "
                                  f"runs TP {peer.tp_size}", {"params_tp_size": p.remote_tp_size,
                                                              "remote_tp_size": peer.tp_size})
        plans = node.plan(peer.side, local_ids, remote_ids, node.hosted_ranks, validated=True)
        reads = [(plan.local_rank, a) for plan in plans for a in _addresses(node, peer, plan)]
        marks = [("plan", time.perf_counter())]

        posted: list[Posted] = []
        try:
            try:
                claim = await peer.client.claim_lease(pb.ClaimLeaseRequest(
                    request_id=p.remote_request_id, lease_epoch=p.remote_epoch, engine_id=node.config.engine_id,
                    tp_size=node.config.tp_size))
            except KvsvcError as e:
                if e.code not in UNKNOWN_OUTCOME:
                    raise ClaimRefused(e) from e  # P answered no: nothing of ours to abort
                raise
            lease = LeaseClock(claim.lease_remaining_ms)
            marks.append(("claim", time.perf_counter()))
            for t, (rr, la, ra, ln) in reads:
                notif = f"{p.remote_request_id}:{t}".encode()  # P-side id, always
                fl = await data.read(t, rr.agent_name, la, ra, ln, notif, rr.memory_kind, rr.device_id)
                posted.append(Posted(t, fl, int(ln.sum()), int(ln.size)))
            marks.append(("post", time.perf_counter()))
            waits = asyncio.gather(*(x.flight.result for x in posted))
            keeper = asyncio.ensure_future(self._heartbeat(peer, p, lease))
            try:
                if time_remaining_s is None:
                    await waits
                else:
                    await asyncio.wait_for(waits, max(0.0, time_remaining_s - (time.perf_counter() - started)))
            except TimeoutError as e:
                raise DeadlineExceeded("DEADLINE_EXCEEDED", "the reads did not finish before the deadline",
                                       {"request_id": req.request_id}) from e
            finally:
                keeper.cancel()
            marks.append(("reads", time.perf_counter()))
            if lease.expired:
                raise FailedPrecondition("LEASE_EXPIRED", "the reads finished after the lease ran out",
                                         {"request_id": p.remote_request_id})
            resp = await peer.client.notify(pb.NotifyRequest(
                request_id=p.remote_request_id, kind=pb.NOTIFY_KIND_CONSUMED, engine_id=node.config.engine_id,
                tp_size=node.config.tp_size, done_ranks=list(node.hosted_ranks), lease_epoch=p.remote_epoch))
            if resp.state not in (pb.LEASE_STATE_CONSUMED, pb.LEASE_STATE_CLAIMED):
                raise FailedPrecondition("LEASE_EXPIRED", f"the prefill server released the blocks "
                                         f"({pb.LeaseState.Name(resp.state)}) before the reads were confirmed",
                                         {"request_id": p.remote_request_id, "state": pb.LeaseState.Name(resp.state)})
        except ClaimRefused as e:
            raise e.error from None
        except BaseException as e:
            # A cancelled or lost claim may have gone through: abort it like any failure.
            await self._fail(peer, p, posted, e)
            if isinstance(e, KvsvcError) and e.code is ErrorCode.UNAVAILABLE and e.reason == "UNAVAILABLE":
                raise Unavailable("PEER_UNAVAILABLE", f"prefill server {p.remote_address} stopped answering: "
                                  f"{e.message}", {"address": p.remote_address},
                                  details=e.details) from e
            raise
        marks.append(("notify", time.perf_counter()))
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

    async def _heartbeat(self, peer: Peer, p: pb.TransferParams, lease: LeaseClock) -> None:
        """Keep P's lease alive while long reads run: HEARTBEAT at a third of the time left."""
        while True:
            await asyncio.sleep(max(HEARTBEAT_MIN_INTERVAL_S, lease.remaining_s / 3))
            try:
                resp = await peer.client.notify(pb.NotifyRequest(
                    request_id=p.remote_request_id, kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id=self.node.config.engine_id,
                    tp_size=self.node.config.tp_size, lease_epoch=p.remote_epoch))
            except KvsvcError:
                log.warning("heartbeat for %s failed", p.remote_request_id)
                continue
            if resp.state not in (pb.LEASE_STATE_CLAIMED, pb.LEASE_STATE_OFFERED):
                return  # released meanwhile: the final notify will say so
            lease.renew(resp.lease_remaining_ms)

    def _aborted(self, p: pb.TransferParams) -> pb.NotifyRequest:
        """ABORTED for the lease behind p, keyed by the P-side request id."""
        return pb.NotifyRequest(request_id=p.remote_request_id, kind=pb.NOTIFY_KIND_ABORTED,
                                engine_id=self.node.config.engine_id, tp_size=self.node.config.tp_size,
                                lease_epoch=p.remote_epoch)

    async def _abort_unpaired(self, p: pb.TransferParams) -> None:
        """Best-effort ABORTED to a P we could not pair with (its lease would otherwise wait out its TTL)."""
        try:
            opts = dataclasses.replace(peer_client_options(self.node), timeout_s=2.0, retries=0)
            async with AsyncClient(p.remote_address, opts) as client:
                await client.notify(self._aborted(p))
        except KvsvcError:
            log.warning("could not tell %s that %s was refused", p.remote_address, p.remote_request_id)

    async def _fail(self, peer: Peer, p: pb.TransferParams, posted: list[Posted], err: BaseException) -> None:
        """Let posted READs settle, tell P to let go, and attach which blocks are valid (none)."""
        settle = [x.flight.settled.wait() for x in posted]
        if settle:
            try:
                await asyncio.shield(asyncio.wait_for(asyncio.gather(*settle), DRAIN_TIMEOUT_S))
            except (TimeoutError, asyncio.CancelledError):
                log.error("READs of %s did not settle in %.0f s", p.remote_request_id, DRAIN_TIMEOUT_S)
        notified = False
        already_released = isinstance(err, KvsvcError) and err.reason == "LEASE_EXPIRED"
        if not already_released:
            try:
                await asyncio.shield(peer.client.notify(self._aborted(p), timeout_s=2.0))
                notified = True
            except (KvsvcError, asyncio.CancelledError):
                log.warning("could not tell %s that %s was aborted", peer.address, p.remote_request_id)
        failure = pb.TransferFailure(valid_local_block_ids_per_group=[], remote_notified=notified)
        if isinstance(err, KvsvcError):
            err.details = (*err.details, failure)
        elif not isinstance(err, asyncio.CancelledError):
            log.exception("transfer %s failed", p.remote_request_id, exc_info=err)

