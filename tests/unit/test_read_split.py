"""split_descriptors: a READ cut into parts for the copy lanes moves exactly the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvsvc.transport.reads import split_descriptors


def byte_pairs(local: np.ndarray, remote: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """Every (local byte, remote byte) a READ moves, in order, spelled out one by one."""
    out = []
    for la, ra, n in zip(local.tolist(), remote.tolist(), length.tolist(), strict=True):
        out.extend((la + i, ra + i) for i in range(n))
    return out


def random_read(rng: np.random.Generator, n: int, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    length = rng.integers(1, max_len, n).astype(np.int64)
    local = rng.permutation(n).astype(np.int64) * (max_len + 7) + 1_000_000
    remote = rng.permutation(n).astype(np.int64) * (max_len + 13) + 5_000_000
    return local, remote, length


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(6))
def test_parts_move_every_byte_once_in_order(parts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    local, remote, length = random_read(rng, int(rng.integers(1, 12)), 3000)
    out = split_descriptors(local, remote, length, parts, align=64)
    assert 1 <= len(out) <= parts
    joined = [pair for la, ra, ln in out for pair in byte_pairs(la, ra, ln)]
    assert joined == byte_pairs(local, remote, length)
    assert all(int(ln.min()) > 0 for _, _, ln in out)


def test_cuts_are_aligned_and_parts_about_equal() -> None:
    # Eight long runs (a contiguous 64 MiB READ of 8 regions), split in two: one cut, in the middle.
    length = np.full(8, 8 << 20, np.int64)
    local = np.arange(8, dtype=np.int64) * (16 << 20)
    remote = local + (1 << 40)
    out = split_descriptors(local, remote, length, 2)
    assert [int(ln.sum()) for _, _, ln in out] == [32 << 20, 32 << 20]
    # A single run splits mid-run, at a page boundary.
    out = split_descriptors(np.array([4096]), np.array([1 << 30]), np.array([10 * 4096 + 100]), 2)
    (la0, ra0, ln0), (la1, ra1, ln1) = out
    assert ln0.tolist() == [5 * 4096] and ln1.tolist() == [5 * 4096 + 100]
    assert la0.tolist() == [4096] and ra0.tolist() == [1 << 30]
    assert la1.tolist() == [4096 + 5 * 4096] and ra1.tolist() == [(1 << 30) + 5 * 4096]


def test_a_read_shorter_than_the_alignment_stays_whole() -> None:
    out = split_descriptors(np.array([0, 100]), np.array([0, 900]), np.array([100, 50]), 4)
    assert len(out) == 1
    assert [a.tolist() for a in out[0]] == [[0, 100], [0, 900], [100, 50]]
