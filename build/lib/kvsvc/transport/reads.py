"""A READ's descriptors: the NIXL handle made from them, and their split into parts of
about equal bytes (for the copy lanes, see copy_lanes.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

SPLIT_ALIGN_BYTES = 4096
"""Cuts between parts fall on multiples of this many bytes of the READ (a page: a copy
that starts mid-page costs more than the cut saves)."""

Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(local addresses, remote addresses, lengths), one entry per descriptor."""


def read_maker(agent: Any, local_memory: str, local_device: int, remote_name: str, local_addr: np.ndarray,
               remote_addr: np.ndarray, length: np.ndarray, remote_memory: str,
               remote_device: int) -> Callable[[], Any]:
    """How to make the READ's handle (called holding NIXL, on the thread that owns `agent`).

    The descriptor arrays are built here, on the caller's thread: the NIXL thread then
    makes only NIXL calls (each of which lets go of the GIL), so a busy event loop delays
    the post less.
    """
    local = np.empty((length.size, 3), dtype=np.uint64)  # (address, length, device) rows
    local[:, 0], local[:, 1], local[:, 2] = local_addr, length, local_device
    remote = local.copy()
    remote[:, 0], remote[:, 2] = remote_addr, remote_device

    def make() -> Any:
        ld = agent.get_xfer_descs(local, local_memory)
        rd = agent.get_xfer_descs(remote, remote_memory)
        return agent.initialize_xfer("READ", ld, rd, remote_name, b"")

    return make


def split_descriptors(local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray, parts: int,
                      align: int = SPLIT_ALIGN_BYTES) -> list[Descriptors]:
    """The READ cut into at most `parts` READs of about equal bytes, in order.

    Byte k of the READ (counting through the descriptors in order) goes to part
    k * parts // total, rounded to `align`: a descriptor that straddles a cut is cut in
    two, so a READ of one long run splits as well as one of many blocks. Every byte is
    in exactly one part; parts that would be empty are left out.
    """
    length = np.asarray(length, dtype=np.int64)
    total = int(length.sum())
    ends = np.cumsum(length)
    starts = ends - length
    cuts = [0]
    for k in range(1, parts):
        cut = (total * k // parts) // align * align
        if cut > cuts[-1]:
            cuts.append(cut)
    cuts.append(total)
    out = []
    for lo, hi in itertools.pairwise(cuts):
        if hi <= lo:
            continue
        first = int(np.searchsorted(ends, lo, side="right"))  # the first descriptor ending after lo
        last = int(np.searchsorted(starts, hi, side="left"))  # one past the last starting before hi
        s, e = starts[first:last], ends[first:last]
        skip = np.maximum(s, lo) - s
        out.append((local_addr[first:last] + skip, remote_addr[first:last] + skip, np.minimum(e, hi) - s - skip))
    return out
