"""D's view of a P engine that may span several servers: which server holds which P ranks,
which hosted D ranks need each one, and the claim D holds at each (one leg per server)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvsvc.codec import bad_field
from kvsvc.errors import FailedPrecondition
from kvsvc.limits import MAX_ADDRESS_BYTES, MAX_TP_SIZE, check_count, check_id
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.service.peers import Peer
from kvsvc.v1 import kv_transfer_pb2 as pb


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
        raise bad_field("params.remote_tp_size", "must be set when params.remote_servers is", "MISSING_FIELD")
    check_count(p.remote_servers, "params.remote_servers", MAX_TP_SIZE)
    out = []
    for i, s in enumerate(p.remote_servers):
        check_id(s.address, f"params.remote_servers[{i}].address", MAX_ADDRESS_BYTES)
        if s.address == p.remote_address and s.epoch != p.remote_epoch:
            # Params edited by hand or stitched from two publishes: trust neither epoch.
            raise bad_field(f"params.remote_servers[{i}].epoch", f"{s.epoch} contradicts params.remote_epoch "
                            f"{p.remote_epoch} for the same server", "PARAMS_INCONSISTENT")
        out.append(ServerRef(s.address, s.epoch, frozenset(s.ranks)))
    return out


def servers_needed(servers: Sequence[ServerRef], hosted: Sequence[int], d_tp: int,
                   p_tp: int) -> list[tuple[ServerRef, list[int]]]:
    """Each server holding a P rank that some hosted D rank reads or notifies, with those D ranks.

    PEER_RANKS_MISSING when a needed P rank is on none of the servers.
    """
    if len(servers) == 1 and servers[0].ranks is None:
        return [(servers[0], list(hosted))]
    targets = {t: set(handshake_target_ranks(t, d_tp, p_tp)) for t in hosted}
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
        raise FailedPrecondition("PEER_RANKS_MISSING", f"prefill ranks {missing[:8]} are on none of the servers the "
                                 "params name", {"ranks": ",".join(map(str, missing[:8]))})
    return out


class ClaimState(enum.Enum):
    NOT_SENT = "not sent"
    SENT = "sent"  # outcome unknown (lost, cancelled): treat as held when cleaning up
    HELD = "held"
    REFUSED = "refused"  # P answered no: nothing of ours to abort there


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


@dataclass
class Leg:
    """The part of a transfer served by one P server."""

    peer: Peer
    d_ranks: list[int]
    claim: ClaimState = ClaimState.NOT_SENT
    clock: LeaseClock | None = None

    @property
    def may_hold(self) -> bool:
        """Whether P may hold a claim of ours here (so an abort is owed)."""
        return self.claim in (ClaimState.SENT, ClaimState.HELD)
