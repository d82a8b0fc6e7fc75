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

A chunk committed layer by layer (Partial) is read layer by layer: the blocks its tokens
fill, in the layers written so far, and the rest of their layers once it is whole. A
cursor keeps, past the blocks read whole, how many were read in their first layers and in
how many; each answer of `next` is a list of Chunks, each read with one range of layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvsvc.errors import InvalidArgument
from kvsvc.reasons import Reason


@dataclass(frozen=True, slots=True)
class GroupShape:
    """What chunking needs to know of one KV cache group."""

    whole_state: bool  # an SSM state: one block, read after the final commit only
    covers_tokens: bool  # its blocks hold the request's tokens in order (attention, MLA)


@dataclass(frozen=True, slots=True)
class Partial:
    """A chunk committed layer by layer, as D has it of every P server (CommitFollower)."""

    whole: tuple[int, ...]  # per group: committed blocks written in every layer (from the start)
    whole_tokens: int  # the request's tokens every layer holds
    layers: tuple[int, ...]  # per group: the layers the rest of the committed blocks hold


class Chunk(NamedTuple):
    """Blocks to read now, one list per group (local and remote paired from their starts),
    in layers [a, b) of each group (None: every layer)."""

    local: list[np.ndarray]
    remote: list[np.ndarray]
    layers: tuple[int, int | None] | None


@dataclass
class _Cursor:
    local: np.ndarray  # D's block ids for the part of the request it reads, in order
    skip: int  # P blocks before local's first (the prefix D holds)
    read: int = 0  # local blocks handed out to read so far, in every layer
    part: int = 0  # local blocks after those handed out in their first part_layers layers only
    part_layers: int = 0


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

    def next(self, committed: Sequence[np.ndarray], *, num_tokens: int, final: bool,
             partial: Partial | None = None) -> list[Chunk]:
        """What can be read now and was not handed out before ([]: nothing yet). committed:
        P's whole block list per group so far; num_tokens: the tokens it holds (in the
        partial chunk's first layers, where one is). BLOCK_COUNT_MISMATCH when P's blocks and
        D's cannot pair (D named fewer or more blocks than the request has)."""
        sets: dict[tuple[int, int | None] | None, Chunk] = {}
        for g, (cursor, shape, blocks) in enumerate(zip(self._cursors, self.shapes, committed, strict=True)):
            blocks = np.asarray(blocks, dtype=np.int64)
            if partial is None or shape.whole_state:
                whole, tokens = blocks, num_tokens
            else:
                whole, tokens = blocks[:partial.whole[g]], partial.whole_tokens
            ready, end = self._ready(g, cursor, shape, whole, tokens, final)
            was, done = cursor.read, min(cursor.read + cursor.part, ready)
            if cursor.part and done > was:  # read before in their first layers: the rest now
                self._add(sets, g, (cursor.part_layers, None), cursor, blocks, was, done, end)
            self._add(sets, g, None, cursor, blocks, done, ready, end)
            cursor.part, cursor.read = max(0, was + cursor.part - ready), ready
            if cursor.part == 0:
                cursor.part_layers = 0
            if partial is not None and not shape.whole_state and not final:
                self._some_layers(sets, g, cursor, shape, blocks, num_tokens, partial.layers[g])
        self.final_seen = self.final_seen or final
        return list(sets.values())

    def _some_layers(self, sets: dict[tuple[int, int | None] | None, Chunk], g: int, cursor: _Cursor,
                     shape: GroupShape, blocks: np.ndarray, num_tokens: int, layers: int) -> None:
        """The partial chunk's blocks its tokens fill, in the layers written so far: those
        read in fewer layers before get the layers between, the others the first ones."""
        if layers <= cursor.part_layers:
            return  # nothing written since (or a layer count going back: never read twice)
        ready, _ = self._ready(g, cursor, shape, blocks, num_tokens, False)
        upto = cursor.read + cursor.part
        if cursor.part:
            self._add(sets, g, (cursor.part_layers, layers), cursor, blocks, cursor.read, upto, None)
        if ready > upto:
            self._add(sets, g, (0, layers), cursor, blocks, upto, ready, None)
        if max(ready, upto) > cursor.read:
            cursor.part, cursor.part_layers = max(ready, upto) - cursor.read, layers

    def _add(self, sets: dict[tuple[int, int | None] | None, Chunk], g: int, layers: tuple[int, int | None] | None,
             cursor: _Cursor, blocks: np.ndarray, first: int, last: int, end: int | None) -> None:
        """Local blocks [first, last) of group g and the P blocks they hold (up to end, where
        the final commit's last block is only partly D's), to be read in `layers`."""
        if last <= first:
            return
        chunk = sets.get(layers)
        if chunk is None:
            n = len(self._cursors)
            chunk = sets[layers] = Chunk([np.empty(0, np.int64)] * n, [np.empty(0, np.int64)] * n, layers)
        step = 1 if self.shapes[g].whole_state else self.ratio
        start, stop = cursor.skip + first * step, cursor.skip + last * step
        chunk.local[g] = cursor.local[first:last]
        chunk.remote[g] = blocks[start:stop if end is None else min(stop, end)]

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
