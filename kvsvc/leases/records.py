"""What the lease table keeps and says: lease states, leases, tombstones, release events,
and the digests and tokens that name them. Values only: no asyncio, no I/O."""

from __future__ import annotations

import enum
import hashlib
import secrets
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.leases.commits import CommitLog
from kvsvc.mapping.release import ReleaseTracker

# What a release costs a subscriber beyond its block ids (the object, its arrays' headers,
# the queue's slot), bytes.
RELEASE_OVERHEAD_BYTES = 512


class LeaseState(enum.Enum):
    OFFERED = "offered"
    CLAIMED = "claimed"
    CONSUMED = "consumed"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def released(self) -> bool:
        return self in (LeaseState.CONSUMED, LeaseState.EXPIRED, LeaseState.ABORTED)


class NotifyKind(enum.Enum):
    CONSUMED = "consumed"
    ABORTED = "aborted"
    HEARTBEAT = "heartbeat"


@dataclass(frozen=True, slots=True)
class Claim:
    """One claimant of a lease: its secret id and the D ranks it reads and notifies for."""

    claim_id: str
    d_ranks: frozenset[int]


@dataclass
class Lease:
    """One published request. Times are time.monotonic() seconds unless named _unix.

    token is the secret handed out in TransferParams; claims maps claim_id to the claim.
    Several claims may hold one lease only when they come from one D engine and cover
    disjoint D ranks (a D engine whose ranks sit on several servers).
    """

    request_id: str
    block_ids: list[np.ndarray]  # uint32 per group: 4 bytes an id (a list of ints costs ~36)
    epoch: int
    expires_at: float
    token: str
    state: LeaseState = LeaseState.OFFERED
    d_engine_id: str = ""
    d_tp_size: int = 0
    d_dcp_size: int = 1
    tracker: ReleaseTracker | None = None
    claims: dict[str, Claim] = field(default_factory=dict)
    released_unix_ms: int = 0
    published_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    digest: bytes = b""  # blocks_digest(block_ids, num_tokens): what a claim must have read
    serial: int = 0  # this lease among every lease this table made: one id leased again is another lease
    # The blocks' content digests as they are taken (service/content.py), when taken: one
    # future for a lease made whole, one batch per commit epoch for a progressive one.
    content: Any = None
    fault: str = ""  # a fault this lease gets (service/faults.py; tests only)
    commits: CommitLog | None = None  # a progressive lease's commit epochs (leases/commits.py); None: made whole
    # Claims of a progressive lease whose READs of what they were handed ended (WaitCommit
    # reads_done): while every claim is, nobody reads the lease (LeaseTable._requiet).
    reads_done: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Whether the lease holds every block it will: made whole, or progressive and final."""
        return self.commits is None or self.commits.final


def claim_digest(claim_id: str) -> bytes:
    """8 bytes that stand for a claim id in a tombstone (kept small: 100k tombstones)."""
    return hashlib.blake2b(claim_id.encode(), digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What stays of a released lease: enough to answer late claims and notifications."""

    state: LeaseState
    released_unix_ms: int
    # For a CONSUMED lease: short digests of the claim ids that consumed it, so that a
    # claimant's retried claim-and-consumed (its stream broke before the answer) is
    # answered CONSUMED again instead of LEASE_EXPIRED (its READs were good).
    consumed_by: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Release:
    """A released request, as WatchReleases reports it.

    free_block_ids: the released blocks no other live lease holds (the same block may sit in
    two leases, e.g. a prefix two requests share): what an engine may reuse now.
    """

    request_id: str
    reason: LeaseState
    block_ids: list[np.ndarray]
    released_unix_ms: int
    free_block_ids: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """What this release holds while it waits for a subscriber (the subscriber's share)."""
        return RELEASE_OVERHEAD_BYTES + len(self.request_id) + sum(
            a.nbytes for a in (*self.block_ids, *self.free_block_ids))


def unix_ms() -> int:
    return int(time.time() * 1000)


def monotonic_to_unix_ms(t: float) -> int:
    return unix_ms() + int((t - time.monotonic()) * 1000)


def new_lease_token() -> str:
    return secrets.token_hex(16)


def blocks_digest(block_ids: Sequence[Sequence[int] | np.ndarray], num_tokens: int) -> bytes:
    """What a lease holds, as ClaimLeaseRequest.blocks_digest spells it (BLAKE2b-128 over
    num_tokens, then per group its count and its ids, each 8 bytes little-endian)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<q", num_tokens))
    for ids in block_ids:
        h.update(struct.pack("<q", len(ids)))
        h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.digest()
