"""D's side of a progressive lease (docs/ARCHITECTURE.md, "Progressive pull"): the WaitCommit
conversation with every P server of a transfer, and what they committed, agreed.

Each P server of an engine (one per worker, in a many-server engine) holds its own lease of
the request and is committed to by its own worker; the block ids are the engine's, the
same on every rank. What D may read is what every server committed: per group, the
prefix of their lists they all hold, checked equal (two servers naming other blocks for
the same request is PARAMS_INCONSISTENT, never a guess). The lease is final when every
server's is. With content digests, each answer brings the digests of the blocks its
commits made whole, per P rank, kept here for the check of what landed (content.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvsvc.codec import block_ids_from_proto
from kvsvc.errors import DeadlineExceeded, InvalidArgument
from kvsvc.layout.engine import EngineLayout
from kvsvc.layout.kinds import policy_of
from kvsvc.layout.specs import SpecFamily
from kvsvc.limits import MAX_WAIT_MS
from kvsvc.mapping.progressive import GroupShape, Partial
from kvsvc.reasons import Reason
from kvsvc.service.legs import LeaseClock, Leg, Ownership
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# A wait for the next commit is held on P at most this long (then asked again): short enough
# that a P which stopped answering is noticed by the call's own timeout, long enough that an
# idle stream costs one call every few seconds, not a poll.
COMMIT_WAIT_S = 5.0
# Room beyond the wait for its answer to travel.
COMMIT_WAIT_MARGIN_S = 1.0


def group_shapes(layout: EngineLayout) -> list[GroupShape]:
    return [GroupShape(whole_state=g.family is SpecFamily.SSM, covers_tokens=policy_of(g.spec_type).blocks_cover_tokens)
            for g in layout.groups]


@dataclass
class _LegCommits:
    epoch: int = 0
    final: bool = False
    num_tokens: int = 0
    blocks: list[np.ndarray] = field(default_factory=list)
    partial: pb.PartialChunk | None = None  # the chunk it commits layer by layer, if any
    digests: dict[int, list[list[int]]] = field(default_factory=dict)  # per P rank, per group, from position 0


class CommitFollower:
    """What the P servers of one transfer committed, followed with WaitCommit (want_content:
    with the digests of the blocks made whole)."""

    def __init__(self, legs: Sequence[Leg], own: Ownership, group_layers: Sequence[int], *,
                 want_content: bool = False, on_unanswered: Callable[[], None] = lambda: None) -> None:
        """group_layers: per group of D's layout, its layers (P's layout has as many).
        on_unanswered: called for each wait P did not answer in time (asked again)."""
        self.legs, self.own, self.want_content = list(legs), own, want_content
        self.group_layers = tuple(group_layers)
        self.on_unanswered = on_unanswered
        self._of = {id(leg): _LegCommits(blocks=[np.empty(0, np.int64)] * len(group_layers)) for leg in legs}

    @property
    def epoch(self) -> int:
        """The least commit epoch D has of any P server."""
        return min(c.epoch for c in self._of.values())

    @property
    def final(self) -> bool:
        return all(c.final for c in self._of.values())

    @property
    def num_tokens(self) -> int:
        return min(c.num_tokens for c in self._of.values())

    def committed(self) -> list[np.ndarray]:
        """Per group, the blocks every P server committed (the prefix they share)."""
        per_leg = list(self._of.values())
        out = []
        for g in range(len(per_leg[0].blocks)):
            n = min(c.blocks[g].size for c in per_leg)
            first = per_leg[0].blocks[g][:n]
            for leg, c in zip(self.legs[1:], per_leg[1:], strict=True):
                if not np.array_equal(c.blocks[g][:n], first):
                    raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"the prefill servers committed other block "
                                          f"ids for request {self.own.params.remote_request_id!r} in group {g}",
                                          {"group": g, "address": leg.peer.address})
            out.append(first)
        if self.final and len({c.num_tokens for c in per_leg}) > 1:
            raise InvalidArgument(Reason.PARAMS_INCONSISTENT, "the prefill servers' final commits give other "
                                  f"lengths for request {self.own.params.remote_request_id!r}",
                                  {"num_tokens": ",".join(str(c.num_tokens) for c in per_leg)})
        return out

    def partial(self, committed: Sequence[np.ndarray]) -> Partial | None:
        """The chunk committed layer by layer, as every P server has it (None: what they
        committed is whole): whole where every server's is, in the layers all wrote.
        committed: what committed() answered."""
        per_leg = list(self._of.values())
        if all(c.partial is None for c in per_leg):
            return None
        whole, layers = [], []
        for g, n in enumerate(b.size for b in committed):
            whole.append(min(n, *(c.blocks[g].size - (c.partial.blocks[g] if c.partial else 0) for c in per_leg)))
            layers.append(min(c.partial.layers_done[g] for c in per_leg if c.partial is not None))
        tokens = min(c.partial.whole_num_tokens if c.partial else c.num_tokens for c in per_leg)
        return Partial(tuple(whole), tokens, tuple(layers))

    async def wait(self, time_left_s: float, *, reads_done: bool = False) -> None:
        """The next commit of every P server whose lease is not final yet (answered at once
        where one came since the epoch D has), or until the wait ends with nothing new.
        reads_done: every READ D posted of what it was handed has ended (P then need not
        progress its data plane for this lease until it hands more). Errors are P's
        (LEASE_EXPIRED once the lease was released) or the call's."""
        until = time.monotonic() + time_left_s
        behind = [leg for leg in self.legs if not self._of[id(leg)].final]
        answers = await asyncio.gather(*(self._wait_one(leg, until, reads_done) for leg in behind))
        for leg, resp in zip(behind, answers, strict=True):
            self._take(leg, resp)

    async def _wait_one(self, leg: Leg, until: float, reads_done: bool) -> pb.WaitCommitResponse:
        p = self.own.params
        req = pb.WaitCommitRequest(request_id=p.remote_request_id, lease_epoch=leg.peer.epoch,
                                   engine_id=self.own.engine_id, claim_id=self.own.claim_id,
                                   after_epoch=self._of[id(leg)].epoch, want_content=self.want_content,
                                   reads_done=reads_done, reads_layers=True)
        while True:
            wait_s = max(0.0, min(COMMIT_WAIT_S, MAX_WAIT_MS / 1000, until - time.monotonic() - COMMIT_WAIT_MARGIN_S))
            req.wait_ms = int(wait_s * 1000)
            try:
                return await leg.peer.client.wait_commit(req, timeout_s=wait_s + COMMIT_WAIT_MARGIN_S)
            except DeadlineExceeded:
                # No answer in time: P's event loop stalled (a host busy for seconds, a long
                # pause) or P stopped. The question stays the same (after_epoch), so it is asked
                # again while P holds the lease as D last heard it and the transfer has time
                # left: a stall ends a stream no more than it ends a lease. A P that stopped for
                # good is given up when its lease would have ended (P releases it then).
                self.on_unanswered()
                lease_over = leg.clock is not None and leg.clock.expired
                if lease_over or until - time.monotonic() <= COMMIT_WAIT_MARGIN_S:
                    raise
                log.info("%s did not answer a wait for commits of %s in time; asking again", leg.peer.address,
                         p.remote_request_id)

    def _take(self, leg: Leg, resp: pb.WaitCommitResponse) -> None:
        c = self._of[id(leg)]
        if resp.commit_epoch < c.epoch:  # answers only move forward; an older one is a P that lost state
            raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"{leg.peer.address} answered commit epoch "
                                  f"{resp.commit_epoch} after {c.epoch}", {"address": leg.peer.address})
        more = block_ids_from_proto(resp.block_ids_per_group) if resp.commit_epoch > c.epoch else []
        if more:
            if len(more) != len(c.blocks):
                raise InvalidArgument(Reason.UNKNOWN_GROUP, f"{leg.peer.address} committed {len(more)} groups, "
                                      f"the layout has {len(c.blocks)}", {"address": leg.peer.address})
            c.blocks = [np.concatenate((held, np.asarray(ids, np.int64))) for held, ids in zip(c.blocks, more,
                                                                                               strict=True)]
        if resp.commit_epoch > c.epoch:
            self._take_digests(leg, c, resp.content)
        c.epoch, c.final, c.num_tokens = resp.commit_epoch, resp.final, resp.num_tokens
        c.partial = self._checked_partial(leg, c, resp) if resp.HasField("partial") else None
        if leg.clock is None:
            leg.clock = LeaseClock(resp.lease_remaining_ms)
        else:
            leg.clock.renew(resp.lease_remaining_ms)

    def _checked_partial(self, leg: Leg, c: _LegCommits, resp: pb.WaitCommitResponse) -> pb.PartialChunk:
        """An answer's chunk committed layer by layer, within what it committed: anything
        else is a P that lost track, never a guess at which layers hold what."""
        part = resp.partial
        ok = (len(part.blocks) == len(part.layers_done) == len(c.blocks) and not resp.final
              and part.whole_num_tokens <= resp.num_tokens
              and all(n <= held.size for n, held in zip(part.blocks, c.blocks, strict=True))
              and all(n <= layers for n, layers in zip(part.layers_done, self.group_layers, strict=True)))
        if not ok:
            raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"{leg.peer.address} answered a chunk committed layer "
                                  f"by layer that its commits do not hold (blocks {list(part.blocks)}, layers "
                                  f"{list(part.layers_done)})", {"address": leg.peer.address})
        return part

    def _take_digests(self, leg: Leg, c: _LegCommits, content: Sequence[pb.BlockContent]) -> None:
        """Append an answer's digests (after its blocks): each group's must start where the ones
        held end and stay within the blocks committed, from a rank that server hosts."""
        for bc in content:
            where = {"address": leg.peer.address, "rank": bc.rank}
            if bc.rank not in leg.peer.ranks or len(bc.groups) != len(c.blocks):
                raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"{leg.peer.address} sent digests for rank "
                                      f"{bc.rank} in {len(bc.groups)} groups, not one of its ranks in "
                                      f"{len(c.blocks)}", where)
            held = c.digests.setdefault(bc.rank, [[] for _ in c.blocks])
            for g, gc in enumerate(bc.groups):
                if gc.first_block != len(held[g]) or len(held[g]) + len(gc.digests) > c.blocks[g].size:
                    raise InvalidArgument(Reason.PARAMS_INCONSISTENT, f"{leg.peer.address} sent digests of blocks "
                                          f"{gc.first_block}..{gc.first_block + len(gc.digests)} of group {g} "
                                          f"after {len(held[g])} of {c.blocks[g].size} committed",
                                          {**where, "group": g, "first_block": gc.first_block})
                held[g].extend(gc.digests)

    def expected_content(self) -> dict[int, dict[tuple[int, int], int]]:
        """Per P rank: the digest of each block, (group, block id), that its server sent."""
        out: dict[int, dict[tuple[int, int], int]] = {}
        for c in self._of.values():
            for rank, groups in c.digests.items():
                out[rank] = {(g, int(b)): d for g, ds in enumerate(groups)
                             for b, d in zip(c.blocks[g][:len(ds)].tolist(), ds, strict=True)}
        return out
