"""What SGLang's kvsvc backend keeps of each request (SGLang's "bootstrap room") on each side,
as explicit state machines.

Pure: no SGLang, ZMQ, grpc or NIXL. The manager (conn.py) holds its lock around a
transition and does what the transition answers (lease, withdraw, fail, start a transfer)
after it; a transition never blocks and never calls out.

P: one room per request on this rank, from D's METADATA (or P's first chunk) until SGLang
clears the request.

    OPEN --last chunk--> LEASING --lease made--> LEASED       (the release ends the request)
      |                     |  '--lease refused--> FAILED
      '--abort--> ABORTED   '--abort--> WITHDRAWING           (taken back once it is made)
                               LEASED --abort--> WITHDRAWING  (taken back now)

Progressive (KVSVC_SGLANG_PROGRESSIVE): the same states, left at the first chunk instead of
the last: LEASING opens the lease with the chunks in so far, and while LEASED each later
chunk is committed to it (take_unsent hands the lease worker what is not in the lease yet,
the last chunk's with `final`); an abort before the final commit takes the lease back even
while D reads it (D fails typed and uses none of it).

D: one room per request, from its METADATA until nothing of its transfer can write any more.

    EXPECTING --every P rank's READY--> RUNNING --settled--> (gone: Success or Failed)
        |                                  |  '--SGLang fails it--> FAILING --settled--> (gone: Failed)
        '--SGLang fails it--> FAILED       '--loaded, P's aux row not here yet--> LOADED
                                              --aux row--> (gone: Success); --SGLang fails it--> FAILED

(Progressive P ranks send READY at their first chunk and the aux row, which exists only
once the last chunk was computed, in a message of its own: the transfer may end first.)

A room SGLang fails while its transfer runs stays FAILING until the transfer settled:
SGLang frees the pages on Failed, and a READ may still land in them until then.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np


class PState(enum.Enum):
    OPEN = "open"  # METADATA and chunks come in; nothing leased
    LEASING = "leasing"  # the last chunk came: the lease worker makes the lease
    LEASED = "leased"  # leased, D told READY: the lease's release ends the request
    FAILED = "failed"  # the lease was refused: nothing leased
    ABORTED = "aborted"  # aborted with nothing leased
    WITHDRAWING = "withdrawing"  # aborted with a lease made or being made: taken back


class OnAbort(enum.Enum):
    """What the manager does for an abort."""

    NOTHING = "nothing"  # aborted already
    FAIL = "fail"  # nothing leased: the request fails now (SGLang frees its pages)
    WITHDRAW = "withdraw"  # take the lease back; fail once nobody can read the pages
    LEASE_WORKER = "lease_worker"  # the lease is being made: the lease worker takes it back


@dataclasses.dataclass
class PRoom:
    """P: one request on this rank."""

    infos: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)  # D ranks' METADATA
    pages: list[np.ndarray] = dataclasses.field(default_factory=list)  # one array per chunk
    window: np.ndarray | None = None  # a hybrid-SWA model's window pages (with the last chunk)
    state: PState = PState.OPEN
    # Progressive only: chunks put in the lease so far, its commit epoch, whether the last
    # chunk came and whether it was committed (final).
    sent: int = 0
    epoch: int = 0
    last_in: bool = False
    final_sent: bool = False
    aux: list[bytes] | None = None  # the request's aux row, with the last chunk

    @property
    def aborted(self) -> bool:
        return self.state in (PState.ABORTED, PState.WITHDRAWING)

    @property
    def leased(self) -> bool:
        """A lease is made (or being made) and not taken back by an abort."""
        return self.state in (PState.LEASING, PState.LEASED)

    def add_chunk(self, pages: np.ndarray, window: np.ndarray | None, progressive: bool = False,
                  last: bool = False, aux: list[bytes] | None = None) -> None:
        """A computed chunk's pages (progressive: taken while the lease grows, too); the last
        one brings the request's aux row."""
        if self.state is PState.OPEN or (progressive and self.state in (PState.LEASING, PState.LEASED)
                                         and not self.last_in):
            self.pages.append(pages)
            if window is not None:
                self.window = window
            self.last_in = self.last_in or last
            if aux is not None:
                self.aux = aux

    def take_unsent(self) -> tuple[np.ndarray, bool, bool] | None:
        """Progressive: (the pages not in the lease yet, final, whether they open it), marked
        sent; None when there is nothing to send (all sent, aborted, refused). Opening moves
        OPEN to LEASING (lease_made() then LEASED); later ones are commits while LEASED."""
        if self.state is PState.OPEN:
            self.state = PState.LEASING
            opening = True
        elif self.state is PState.LEASED and not self.final_sent:
            opening = False
        else:
            return None
        if not opening and self.sent == len(self.pages) and not self.last_in:
            return None
        pages = self.pages[self.sent:]
        self.sent = len(self.pages)
        self.epoch += 1
        self.final_sent = self.last_in
        return (np.concatenate(pages) if pages else np.zeros(0, np.int64)), self.last_in, opening

    def stop_stream(self) -> None:
        """Progressive: the lease refused a commit (D gave it up, or it expired; its release
        ends the request): nothing more is committed to it."""
        self.final_sent = True

    @property
    def pages_sent(self) -> int:
        return sum(len(p) for p in self.pages[:self.sent])

    def start_lease(self) -> np.ndarray | None:
        """The last chunk is in: the request's pages to lease, or None (aborted, or leased already)."""
        if self.state is not PState.OPEN:
            return None
        self.state = PState.LEASING
        return np.concatenate(self.pages) if self.pages else np.zeros(0, np.int64)

    def lease_made(self) -> bool:
        """True: tell D; False: aborted while the lease was made, take it back."""
        if self.state is PState.LEASING:
            self.state = PState.LEASED
            return True
        return False

    def lease_refused(self) -> None:
        if self.state is PState.LEASING:
            self.state = PState.FAILED

    def abort(self) -> OnAbort:
        if self.aborted:
            return OnAbort.NOTHING
        before, self.state = self.state, (PState.WITHDRAWING if self.leased else PState.ABORTED)
        if before is PState.LEASING:
            return OnAbort.LEASE_WORKER
        return OnAbort.WITHDRAW if before is PState.LEASED else OnAbort.FAIL


class PRooms:
    """P's rooms, bounded: a D that names rooms P never serves (or names them after they
    ended) must not grow them without end; the oldest go first. Also the failures of rooms
    already cleared, so a METADATA that comes after P ended the request hears why."""

    def __init__(self, limit: int, evicted: Callable[[int], None]) -> None:
        self._rooms: dict[int, PRoom] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._limit = limit
        self._evicted = evicted  # told each room id dropped to stay in bound

    def get(self, room_id: int) -> PRoom | None:
        return self._rooms.get(room_id)

    def get_or_make(self, room_id: int) -> PRoom:
        room = self._rooms.get(room_id)
        if room is None:
            while len(self._rooms) >= self._limit:
                oldest = next(iter(self._rooms))
                del self._rooms[oldest]
                self._evicted(oldest)
            room = self._rooms[room_id] = PRoom()
        return room

    def ended(self, room_id: int) -> str | None:
        """Why an already cleared room failed (None: not cleared, or it succeeded)."""
        return self._ended.get(room_id)

    def clear(self, room_id: int, failure: str | None) -> PRoom | None:
        room = self._rooms.pop(room_id, None)
        if failure is not None:
            self._ended[room_id] = failure
            while len(self._ended) > self._limit:
                self._ended.popitem(last=False)
        return room

    def __len__(self) -> int:
        return len(self._rooms)


class DState(enum.Enum):
    EXPECTING = "expecting"  # METADATA sent; READY pieces come in
    RUNNING = "running"  # the transfer runs
    FAILING = "failing"  # SGLang failed it while the transfer runs: Failed once it settled
    FAILED = "failed"  # SGLang failed it before a transfer started, or while LOADED: none will
    LOADED = "loaded"  # the transfer succeeded; P's aux row has not come yet (progressive)


@dataclasses.dataclass
class DRoom:
    """D: one request on this rank."""

    pages: np.ndarray
    aux_index: int
    expected: int  # READY messages to wait for: one per P rank D sent METADATA to
    window: np.ndarray | None = None  # a hybrid-SWA model's window pages
    pieces: dict[int, Any] = dataclasses.field(default_factory=dict)
    state: DState = DState.EXPECTING
    transfer: Any = None  # the running transfer's future
    auxes: dict[int, list[bytes]] = dataclasses.field(default_factory=dict)  # aux rows by P rank (progressive)

    def add_piece(self, p_rank: int, piece: Any) -> list[Any] | None:
        """Every P rank's piece once the last comes (the transfer may start), else None
        (more to come, a duplicate, or too late)."""
        if self.state is not DState.EXPECTING:
            return None
        self.pieces[p_rank] = piece
        return list(self.pieces.values()) if len(self.pieces) >= self.expected else None

    def run(self, transfer: Any) -> None:
        assert self.state is DState.EXPECTING, self.state
        self.state, self.transfer = DState.RUNNING, transfer

    def add_aux(self, p_rank: int, rows: list[bytes]) -> None:
        if p_rank not in self.auxes:
            self.auxes[p_rank] = rows

    def aux(self) -> list[bytes] | None:
        """The aux row to write: the lowest P rank's, once it came (READY's, or its own message)."""
        if not self.pieces:
            return None
        first = min(self.pieces)
        if first in self.auxes:
            return self.auxes[first]
        piece = self.pieces[first]
        return None if piece.params.progressive else piece.aux

    def loaded(self) -> bool:
        """The transfer succeeded but the aux row has not come: True, wait for it (LOADED);
        False: it is here, finish now."""
        if self.state is DState.RUNNING and self.aux() is None:
            self.state = DState.LOADED
            return True
        return False

    @property
    def running(self) -> bool:
        """A transfer may still write into the pages."""
        return self.state in (DState.RUNNING, DState.FAILING) and not self.transfer.done()

    def fail(self) -> bool:
        """SGLang fails the room. True: a transfer may still write, cancel it (the room fails
        once it settled); False: fail now (no transfer runs, and none will start)."""
        if self.state in (DState.EXPECTING, DState.LOADED):
            self.state = DState.FAILED
        elif self.state is DState.RUNNING:
            self.state = DState.FAILING
        return self.running
