"""Per-request block contents for fault tests: which request's bytes does a block hold?

For two engines with the same layout and TP (the fault and chaos tests use TP 1 -> 1),
block i of a request holds, in every region, 64-bit words that name the request (a
seed) and the block's position in it. A block read after P reused it for another
request carries the other request's seed, so a wrong read reported good shows. It is
deliberately simpler than kvsvc.verify (and shares no code with kvsvc.mapping).
"""

from __future__ import annotations

import numpy as np

from kvsvc.verify import RankMemory


def _words(seed: int, region: int, position: int, nbytes: int) -> np.ndarray:
    word = np.uint64(seed) * np.uint64(1_000_003) + np.uint64(region * 1009 + position + 1)
    return np.full(nbytes // 8, word, dtype=np.uint64)


def stamp(mem: RankMemory, ids: list[int], seed: int) -> None:
    """Write request `seed`'s contents into blocks ids (position = index in ids)."""
    for x, r in enumerate(mem.regions):
        for pos, b in enumerate(ids):
            mem.block_view(r, b).view(np.uint64)[:] = _words(seed, x, pos, r.block_len)


def holds(mem: RankMemory, ids: list[int], seed: int) -> bool:
    """Whether blocks ids hold exactly request `seed`'s contents."""
    for x, r in enumerate(mem.regions):
        for pos, b in enumerate(ids):
            if not np.array_equal(mem.block_view(r, b).view(np.uint64), _words(seed, x, pos, r.block_len)):
                return False
    return True
