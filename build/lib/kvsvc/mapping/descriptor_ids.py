"""Descriptor ids over prepared per-block descriptor lists (MAPPING.md §5).

For engines that prepare one descriptor per (region, block) with NIXL and post by id:
id = region·num_blocks + block, region-major, every group's blocks concatenated per
region. SSM sub-regions follow all attention ids. kvsvc's own transfers post the
coalesced ranges of geometry.py instead; this is the id form for parity and for engines.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def descriptor_ids(
    block_ids_per_group: Sequence[Sequence[int]],
    *,
    num_regions: int,
    num_blocks: int,
    ssm_groups: Sequence[int] = (),
    num_ssm_regions: int = 0,
    ssm_logical_blocks: int | None = None,
) -> np.ndarray:
    """Ids of the blocks of every group, region-major, as one int64 array.

    num_regions counts the attention regions; ssm_groups are the indices of SSM groups,
    whose blocks index num_ssm_regions sub-regions of ssm_logical_blocks blocks each.
    """
    ssm = set(ssm_groups)
    attn = [np.asarray(ids, np.int64) for g, ids in enumerate(block_ids_per_group) if g not in ssm]
    attn_ids = np.concatenate(attn) if attn else np.zeros(0, np.int64)
    regions = np.arange(num_regions, dtype=np.int64)[:, None] * num_blocks
    out = [(regions + attn_ids[None, :]).ravel()]
    if ssm:
        base = num_regions * num_blocks
        logical = num_blocks if ssm_logical_blocks is None else ssm_logical_blocks
        ssm_ids = np.concatenate([np.asarray(block_ids_per_group[g], np.int64) for g in sorted(ssm)])
        subs = np.arange(num_ssm_regions, dtype=np.int64)[:, None] * logical
        out.append((base + subs + ssm_ids[None, :]).ravel())
    return np.concatenate(out)
