"""Server-owned DRAM pools are backed page by page at start, or refused clearly when /dev/shm cannot."""

from __future__ import annotations

import errno
import os
import uuid

import pytest

from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.memory.pools import ShmPool

MiB = 2**20


def shm_path(name: str) -> str:
    return f"/dev/shm/{name.lstrip('/')}"


def test_a_new_pool_has_every_page_allocated():
    name = f"kvsvc-test-{uuid.uuid4().hex[:12]}"
    pool = ShmPool(0, 8 * MiB, name)
    try:
        # A segment only truncated to size has no blocks; every page of this one is backed.
        assert os.stat(shm_path(name)).st_blocks * 512 >= 8 * MiB
        assert pool.array[:: 4096].sum() == 0  # and reads as zeros
    finally:
        pool.close()
    assert not os.path.exists(shm_path(name))


def test_a_pool_dev_shm_cannot_hold_is_refused_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch):
    # Filling a real /dev/shm would take the host's memory with it: the kernel's ENOSPC is faked.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = f"kvsvc-test-{uuid.uuid4().hex[:12]}"
    with pytest.raises(KvsvcError) as e:
        ShmPool(0, 64 * MiB, name)
    assert e.value.reason == "POOL_NO_MEMORY" and e.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert e.value.metadata["bytes"] == str(64 * MiB) and "No space left" in e.value.message
    assert not os.path.exists(shm_path(name))  # the segment was unlinked
