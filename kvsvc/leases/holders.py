"""How many live leases hold each block: what a release frees (a block two leases share,
e.g. a common prefix, is free only once both are released) and how many block ids the
table holds (its quota)."""

from __future__ import annotations

import numpy as np


class BlockHolders:
    """Per group, a count of live leases holding each block id (grown to the largest id seen)."""

    def __init__(self) -> None:
        self._holders: list[np.ndarray] = []
        self.leased_blocks = 0  # block ids held by live leases (a block in two leases counts twice)

    def hold(self, blocks: list[np.ndarray], delta: int) -> None:
        """Count (delta +1) or uncount (-1) a lease's blocks."""
        while len(self._holders) < len(blocks):
            self._holders.append(np.zeros(0, dtype=np.int32))
        for g, ids in enumerate(blocks):
            if not ids.size:
                continue
            need = int(ids.max()) + 1
            if need > self._holders[g].size:  # grows to the largest block id seen (the pool's size)
                grown = np.zeros(max(need, 2 * self._holders[g].size), dtype=np.int32)
                grown[:self._holders[g].size] = self._holders[g]
                self._holders[g] = grown
            np.add.at(self._holders[g], ids, delta)  # add.at: a block listed twice counts twice
            self.leased_blocks += delta * int(ids.size)

    def now_free(self, blocks: list[np.ndarray]) -> list[np.ndarray]:
        """Of a released lease's blocks (already uncounted), those no live lease holds, sorted."""
        out = []
        for g, ids in enumerate(blocks):
            unique = np.unique(ids)
            out.append(unique[self._holders[g][unique] == 0] if unique.size else unique)
        return out
