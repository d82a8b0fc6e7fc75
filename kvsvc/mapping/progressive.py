"""Which blocks a progressive transfer can read next (docs/ARCHITECTURE.md, "Progressive pull").

A plain transfer knows P's whole block list and aligns D's blocks with its end (a D holding
a prefix names only the tail). A growing lease has no end yet, so a progressive transfer
aligns D's blocks with its start: D says how many of the request's leading tokens it holds
already (whole local blocks), and local block j of a group is P's blocks
skip + j*ratio .. skip + (j+1)*ratio - 1, where skip is those tokens in P blocks and ratio
is how many P blocks make one D block.

`ProgressiveBlocks.next` is handed what P committed so far and answers the local and remote
ids not read yet that can be read now, per group, in the shape the planner takes (a slice
of each group's lists, paired from their starts). A D block is read once every P block of
it holds committed tokens; before the final commit only blocks whole tokens cover count
(the commit rule says committed blocks never change, but a block the tokens do not fill
yet would be read half-made if an engine broke it). An SSM group's state is one block the
engine rewrites each chunk: it is read once, after the final commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.errors import InvalidArgument
from kvsvc.reasons import Reason


@dataclass(frozen=True, slots=True)
class GroupShape:
    """What chunking needs to know of one KV cache group."""

    whole_state: bool  # an SSM state: one block, read after the final commit only
    covers_tokens: bool  # its blocks hold the request's tokens in order (attention, MLA)


@dataclass
class _Cursor:
    local: np.ndarray  # D's block ids for the part of the request it reads, in order
    skip: int  # P blocks before local's first (the prefix D holds)
    read: int = 0  # local blocks handed out to read so far


class ProgressiveBlocks:
    """D's progress through one growing lease, group by group."""

    def __init__(self, local_ids: Sequence[Sequence[int] | np.ndarray], shapes: Sequence[GroupShape], *,
                 prefix_tokens: int, local_block_size: int, remote_block_size: int) -> None:
        if prefix_tokens % local_block_size:
            raise InvalidArgument(Reason.INVALID_FIELD, f"local_prefix_tokens {prefix_tokens} is not a whole number "
                                  f"of local blocks of {local_block_size} tokens",
                                  {"field": "local_prefix_tokens", "local_prefix_tokens": prefix_tokens,
                                   "block_size": local_block_size})
        self.ratio = local_block_size // remote_block_size
        self.remote_block_size = remote_block_size
        self.shapes = list(shapes)
        skip = prefix_tokens // remote_block_size
        self._cursors = [_Cursor(np.asarray(ids, dtype=np.int64), 0 if shape.whole_state else skip)
                         for ids, shape in zip(local_ids, shapes, strict=True)]
        self.final_seen = False

    @property
    def done(self) -> bool:
        """Every local block was handed out, after the final commit."""
        return self.final_seen and all(c.read == c.local.size for c in self._cursors)

    def next(self, committed: Sequence[np.ndarray], *, num_tokens: int,
             final: bool) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """(local ids, remote ids) per group that can be read now and were not handed out
        before; None when no group has any. committed: P's whole block list per group so
        far; num_tokens: the tokens it holds. BLOCK_COUNT_MISMATCH when P's blocks and D's
        cannot pair (D named fewer or more blocks than the request has)."""
        local_out, remote_out = [], []
        for g, (cursor, shape, blocks) in enumerate(zip(self._cursors, self.shapes, committed, strict=True)):
            ready, end = self._ready(g, cursor, shape, np.asarray(blocks), num_tokens, final)
            start = cursor.skip + cursor.read * (1 if shape.whole_state else self.ratio)
            local_out.append(cursor.local[cursor.read:ready])
            remote_out.append(np.asarray(blocks, dtype=np.int64)[start:end])
            cursor.read = ready
        self.final_seen = self.final_seen or final
        if not any(ids.size for ids in local_out):
            return None
        return local_out, remote_out

    def _ready(self, g: int, cursor: _Cursor, shape: GroupShape, blocks: np.ndarray, num_tokens: int,
               final: bool) -> tuple[int, int]:
        """(local blocks readable in all, where in P's list they end)."""
        have = cursor.local.size
        if shape.whole_state:
            if not final:
                return cursor.read, cursor.skip
            _pair_or_refuse(g, have, blocks.size, blocks.size, 1)
            return have, blocks.size
        ratio = self.ratio
        full = whole_blocks(shape, blocks.size, num_tokens=num_tokens, block_size=self.remote_block_size, final=final)
        if final:
            needed = max(0, -(-(full - cursor.skip) // ratio))
            _pair_or_refuse(g, have, needed, full - cursor.skip, ratio)
            return have, max(cursor.skip, full)
        if full - cursor.skip > have * ratio:
            _pair_or_refuse(g, have, -(-(full - cursor.skip) // ratio), full - cursor.skip, ratio)
        ready = min(have, max(0, (full - cursor.skip) // ratio))
        return max(ready, cursor.read), cursor.skip + max(ready, cursor.read) * ratio


def whole_blocks(shape: GroupShape, committed: int, *, num_tokens: int, block_size: int, final: bool) -> int:
    """How many of a growing lease's committed blocks of one group (from its start) hold what
    they will hold for good: those whole tokens fill (a block covering tokens), every one
    (a block that does not), an SSM state only once final; at the final commit every block
    the request's tokens reach. D reads these (ProgressiveBlocks); P takes their content
    digests (service/content.py)."""
    if shape.whole_state:
        return committed if final else 0
    if not shape.covers_tokens:
        return committed
    if final:
        return min(committed, -(-num_tokens // block_size))
    return min(committed, num_tokens // block_size)


def _pair_or_refuse(group: int, have: int, needed: int, remote_blocks: int, ratio: int) -> None:
    if have != needed:
        raise InvalidArgument(Reason.BLOCK_COUNT_MISMATCH,
                              f"group {group}: D named {have} local blocks but the request's "
                              f"{max(0, remote_blocks)} remote blocks after D's prefix fill {needed} "
                              f"(local blocks of {ratio} remote ones)",
                              {"group": group, "local_blocks": have, "remote_blocks": max(0, remote_blocks),
                               "needed": needed, "block_ratio": ratio})
