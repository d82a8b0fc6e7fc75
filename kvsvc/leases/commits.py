"""What a progressive lease committed, epoch by epoch (docs/ARCHITECTURE.md, "Progressive
pull"). Values only: no asyncio, no I/O.

A progressive lease is opened before P's prefill ends and grows: each commit appends the
blocks of one more chunk to every group and moves the lease's commit epoch on by one. The
commit rule: commits only append (a committed block stays in the lease, with its content,
until the lease is released); a commit names the next epoch; the same epoch sent again with
the same blocks is a retry, answered as the first; anything else is refused, typed; nothing
is committed after the final commit.

A chunk may be committed layer by layer (`layers`, one count per group): its first such
commit appends its blocks, written so far in the first n layers of each group; the next
ones append nothing and only raise the counts (a layer committed stays committed); the
commit that makes the chunk whole names no counts and is the only one that may be final.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.reasons import Reason

MAX_COMMITS = 4096  # epochs one lease may reach: a 1M-token prompt in chunks of 256


@dataclass
class CommitLog:
    """The commit epochs of one progressive lease: after epoch e, group g held ends[e-1][g]
    of the lease's block ids (the first ends[e-1][g] of its list)."""

    ends: list[tuple[int, ...]] = field(default_factory=list)
    final: bool = False
    num_tokens: int = 0
    layers: list[tuple[int, ...]] = field(default_factory=list)  # per epoch: its layer counts (): whole
    # While a chunk is committed layer by layer: per group, how many of the last blocks are
    # its; and the tokens every layer holds (num_tokens is the tokens its first layers hold).
    partial: tuple[int, ...] = ()
    whole_tokens: int = 0
    whole_epoch: int = 1  # the last commit that left every block whole (what a D reading no layers sees)

    @classmethod
    def opened(cls, blocks: Sequence[np.ndarray], num_tokens: int, final: bool = False) -> CommitLog:
        """The log of a lease opened with `blocks` (possibly none): epoch 1."""
        return cls([tuple(int(a.size) for a in blocks)], final, num_tokens, [()], whole_tokens=num_tokens)

    @property
    def layers_done(self) -> tuple[int, ...]:
        """Per group, in how many of its first layers the chunk committed layer by layer is
        written; (): none is (every committed block holds its tokens in every layer)."""
        return self.layers[-1]

    @property
    def epoch(self) -> int:
        return len(self.ends)

    def accept(self, request_id: str, held: Sequence[np.ndarray], epoch: int, appended: Sequence[np.ndarray],
               num_tokens: int, final: bool, layers: tuple[int, ...] = ()) -> bool:
        """Check a commit against the log and the lease's blocks (held). True: a new commit,
        which the caller applies (append, then record()); False: a retry of a commit already
        made, with the same blocks (nothing to do). Raises the typed refusal otherwise.
        layers: a commit layer by layer's counts per group (the caller checked each against
        its group's layers); (): the blocks are whole."""
        where = {"request_id": request_id, "commit_epoch": epoch, "lease_commit_epoch": self.epoch}
        if len(appended) != len(held) or (layers and len(layers) != len(held)):
            what, n = ("layers_done", len(layers)) if len(appended) == len(held) else ("block_ids_per_group",
                                                                                       len(appended))
            raise InvalidArgument(Reason.INVALID_FIELD, f"the commit has {n} groups, the lease {len(held)}",
                                  {**where, "field": what, "groups": n, "lease_groups": len(held)})
        if layers and final:
            raise InvalidArgument(Reason.INVALID_FIELD, "a commit layer by layer is never final: the final commit "
                                  "makes the chunk whole (no layers_done)", {**where, "field": "layers_done"})
        if 2 <= epoch <= self.epoch:  # a retry: the same blocks, or a conflict
            start, end = self.ends[epoch - 2], self.ends[epoch - 1]
            same = all(np.array_equal(h[s:e], a) for h, s, e, a in zip(held, start, end, appended, strict=True))
            same = same and self.layers[epoch - 1] == layers
            if not same or (epoch == self.epoch and final != self.final) or (epoch < self.epoch and final):
                raise FailedPrecondition(Reason.COMMIT_CONFLICT, f"commit epoch {epoch} of request {request_id!r} "
                                         "was made with other blocks: a committed chunk never changes", where)
            return False
        if self.final:
            raise FailedPrecondition(Reason.LEASE_FINAL, f"request {request_id!r} had its final commit (epoch "
                                     f"{self.epoch}): nothing is committed after it", where)
        if epoch != self.epoch + 1:
            raise FailedPrecondition(Reason.COMMIT_OUT_OF_ORDER, f"request {request_id!r} is at commit epoch "
                                     f"{self.epoch}: the next commit is epoch {self.epoch + 1}, not {epoch}", where)
        if epoch > MAX_COMMITS:
            raise InvalidArgument(Reason.FIELD_TOO_LARGE, f"a lease takes at most {MAX_COMMITS} commits",
                                  {**where, "max_commits": MAX_COMMITS})
        if num_tokens < self.num_tokens:
            raise InvalidArgument(Reason.INVALID_FIELD, f"num_tokens {num_tokens} is less than the {self.num_tokens} "
                                  "already committed", {**where, "field": "num_tokens"})
        if layers and self.layers_done:  # the chunk committed layer by layer goes on
            if any(a.size for a in appended):
                raise FailedPrecondition(Reason.COMMIT_CONFLICT, f"request {request_id!r} has a chunk committed layer "
                                         "by layer: the commits that follow name no blocks until one makes it whole",
                                         {**where, "field": "block_ids_per_group"})
            if any(n < had for n, had in zip(layers, self.layers_done, strict=True)):
                raise FailedPrecondition(Reason.COMMIT_CONFLICT, f"request {request_id!r}: layers_done "
                                         f"{list(layers)} goes back from {list(self.layers_done)} (a layer committed "
                                         "stays committed)", {**where, "field": "layers_done"})
        return True

    def record(self, held: Sequence[np.ndarray], num_tokens: int, final: bool, layers: tuple[int, ...] = ()) -> int:
        """A commit was applied (held: the lease's blocks after it); its epoch."""
        if not layers:
            self.partial, self.whole_tokens, self.whole_epoch = (), num_tokens, len(self.ends) + 1
        elif not self.layers_done:  # the chunk starts: the blocks this commit appended are its
            self.partial = tuple(int(a.size) - e for a, e in zip(held, self.ends[-1], strict=True))
        self.ends.append(tuple(int(a.size) for a in held))
        self.layers.append(layers)
        self.num_tokens = num_tokens
        self.final = final
        return self.epoch

    def seen_epoch(self, layers: bool) -> int:
        """The epoch a D sees: every commit where it reads chunks layer by layer, else the last
        that left every block whole (a partial chunk stays hidden from it until made whole)."""
        return self.epoch if layers else self.whole_epoch

    def since(self, after_epoch: int, upto: int | None = None) -> list[tuple[int, int]]:
        """Per group, the (start, end) of the block ids committed after after_epoch (0: all)
        up to epoch upto (None: the last)."""
        upto = self.epoch if upto is None else upto
        if not 0 <= after_epoch <= upto:
            raise FailedPrecondition(Reason.COMMIT_OUT_OF_ORDER, f"commit epoch {after_epoch} was never reached "
                                     f"(the lease is at {upto})",
                                     {"after_epoch": after_epoch, "lease_commit_epoch": upto})
        start = self.ends[after_epoch - 1] if after_epoch else (0,) * len(self.ends[-1])
        return list(zip(start, self.ends[upto - 1], strict=True))
