"""Decode context parallelism (DCP) for MLA: who holds which blocks of a request (MAPPING.md §9).

An engine with DCP size d deals a request's blocks out over its ranks: position j of
rank r's block list holds the request's block g = j·d + r % d (d = 1: every rank holds
every block, the latent cache being replicated). Both sides use DCP 1 or their TP size,
and the two sizes divide one another, so one closed rule says which remote ranks hold a
local rank's blocks; the block pairs to read are then found from global positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsvc.errors import InvalidArgument
from kvsvc.reasons import Reason


def dcp_source_ranks(tp_rank: int, local_dcp: int, remote_tp: int, remote_dcp: int) -> list[int]:
    """The remote ranks holding some of local rank tp_rank's blocks, when the remote uses DCP.

    Local DCP no finer than the remote's: every remote rank r with r % local_dcp equal to
    the local DCP rank (local DCP 1: all of them). Finer: the one remote rank whose blocks
    contain all of this rank's.
    """
    mine = tp_rank % local_dcp
    if local_dcp <= remote_dcp:
        return [r for r in range(remote_tp) if r % local_dcp == mine]
    return [mine % remote_dcp]


def request_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of block_size tokens a request of num_tokens tokens fills."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class DcpGroup:
    """One MLA group of one request under DCP, paired once for every local rank.

    local_ids: the local block list as given (positions computed, computed + 1, ...);
    remote_ids: the remote list (position i on remote rank r holds block i·remote_dcp + r);
    computed: local positions a prefix hit already holds; num_blocks: the request's blocks.
    """

    local_ids: np.ndarray
    remote_ids: np.ndarray
    computed: int
    num_blocks: int
    local_dcp: int
    remote_dcp: int

    def pairs(self, local_rank: int, remote_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(local ids, remote ids) of the blocks local_rank reads from remote_rank."""
        j = np.arange(self.computed, self.computed + self.local_ids.size, dtype=np.int64)
        g = j * self.local_dcp + local_rank % self.local_dcp  # the request block at each local position
        keep = (g < self.num_blocks) & (g % self.remote_dcp == remote_rank % self.remote_dcp)
        return self.local_ids[keep], self.remote_ids[g[keep] // self.remote_dcp]


def dcp_group(local_ids: np.ndarray, remote_ids: np.ndarray, *, num_tokens: int, block_size: int,
              local_dcp: int, remote_dcp: int, group: int) -> DcpGroup:
    """Check one group's lists against the request length; BLOCK_COUNT_MISMATCH / NUM_TOKENS_REQUIRED.

    A local list shorter than the local positions the request needs is a prefix hit: it
    starts after the positions already held.
    """
    if num_tokens:
        total = request_blocks(num_tokens, block_size)
    elif remote_dcp == 1:
        total = int(remote_ids.size)  # a replicated remote lists every block of the request
    else:
        raise InvalidArgument(
            Reason.NUM_TOKENS_REQUIRED,
            f"the remote engine deals its blocks over {remote_dcp} DCP ranks: the request's length in tokens "
            "(TransferParams.remote_num_tokens, PublishBlocksRequest.num_tokens) must be given",
            {"remote_dcp_size": remote_dcp})
    remote_needed = -(-total // remote_dcp)
    if remote_ids.size < remote_needed:
        raise InvalidArgument(
            Reason.BLOCK_COUNT_MISMATCH,
            f"group {group}: a request of {total} blocks needs {remote_needed} remote block ids per rank at DCP "
            f"{remote_dcp}, got {remote_ids.size}",
            {"group": group, "remote_blocks": int(remote_ids.size), "needed": remote_needed, "num_tokens": num_tokens})
    local_needed = -(-total // local_dcp)
    if local_ids.size > local_needed:
        raise InvalidArgument(
            Reason.BLOCK_COUNT_MISMATCH,
            f"group {group}: {local_ids.size} local block ids but a request of {total} blocks fills only "
            f"{local_needed} per rank at DCP {local_dcp}",
            {"group": group, "local_blocks": int(local_ids.size), "needed": local_needed, "num_tokens": num_tokens})
    return DcpGroup(local_ids, remote_ids, local_needed - int(local_ids.size), total, local_dcp, remote_dcp)
