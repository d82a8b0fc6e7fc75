"""Which blocks a progressive transfer reads as P commits (kvsvc/mapping/progressive.py).

The checker pairs blocks its own way: local block j holds the request's tokens from
(prefix_tokens + j*local_bs), which P holds in its blocks from that token on; every local
block must be handed out exactly once, with exactly those P blocks, and only once P
committed them with the tokens they hold (or after the final commit).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvsvc.errors import InvalidArgument
from kvsvc.mapping.progressive import GroupShape, ProgressiveBlocks

ATTN = GroupShape(whole_state=False, covers_tokens=True)
SSM = GroupShape(whole_state=True, covers_tokens=False)


def expected_pairs(local: list[int], p_blocks: list[int], prefix_tokens: int, local_bs: int, remote_bs: int,
                   num_tokens: int) -> list[tuple[int, list[int]]]:
    out = []
    for j, lb in enumerate(local):
        first_token = prefix_tokens + j * local_bs
        last_token = min(first_token + local_bs, num_tokens)
        out.append((lb, [p_blocks[t // remote_bs] for t in range(first_token, last_token, remote_bs)]))
    return out


def stream(blocks: ProgressiveBlocks, commits: list[tuple[int, int, bool]], p_blocks: list[int],
           remote_bs: int) -> list[tuple[int, list[int], int, int]]:
    """Feed commits (blocks committed, tokens committed, final); every handed-out local block
    with its P blocks, and what was committed when it was handed out."""
    got = []
    for n_blocks, tokens, final in commits:
        chunk = blocks.next([np.array(p_blocks[:n_blocks])], num_tokens=tokens, final=final)
        if chunk is None:
            continue
        (local,), (remote,) = chunk
        ratio = blocks.ratio
        remote = remote.tolist()
        for j, lb in enumerate(local.tolist()):
            got.append((lb, remote[j * ratio:(j + 1) * ratio], n_blocks, tokens if not final else 1 << 40))
    return got


@pytest.mark.parametrize("seed", range(40))
def test_every_local_block_is_read_once_with_its_p_blocks_and_only_once_committed(seed):
    rng = random.Random(seed)
    remote_bs = rng.choice([1, 4, 16])
    ratio = rng.choice([1, 1, 2, 4])
    local_bs = remote_bs * ratio
    num_tokens = rng.randint(1, 300)
    prefix_tokens = local_bs * rng.randint(0, (num_tokens - 1) // local_bs)
    p_count = -(-num_tokens // remote_bs)
    p_blocks = rng.sample(range(1000), p_count)
    local_count = -(-(num_tokens - prefix_tokens) // local_bs)
    local = rng.sample(range(1000), local_count)
    commits, tokens = [], 0
    while tokens < num_tokens:  # chunks of any size; the blocks whole tokens fill are committed
        tokens = min(num_tokens, tokens + rng.randint(1, 64))
        final = tokens == num_tokens
        commits.append((p_count if final else tokens // remote_bs, tokens, final))
    blocks = ProgressiveBlocks([local], [ATTN], prefix_tokens=prefix_tokens, local_block_size=local_bs,
                               remote_block_size=remote_bs)
    got = stream(blocks, commits, p_blocks, remote_bs)
    assert blocks.done
    want = expected_pairs(local, p_blocks, prefix_tokens, local_bs, remote_bs, num_tokens)
    assert [(lb, rb) for lb, rb, _, _ in got] == want
    for lb, rb, committed_blocks, committed_tokens in got:
        j = local.index(lb)
        needs_tokens = prefix_tokens + (j + 1) * local_bs
        assert committed_tokens >= min(needs_tokens, num_tokens), (lb, committed_tokens)
        assert all(p_blocks.index(b) < committed_blocks for b in rb)


def test_a_block_committed_with_tokens_that_do_not_fill_it_waits_for_the_next_commit():
    blocks = ProgressiveBlocks([[7, 8]], [ATTN], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    # P committed both its blocks, but its tokens fill only the first: the second waits.
    (local,), (remote,) = blocks.next([np.array([1, 2])], num_tokens=6, final=False)
    assert (local.tolist(), remote.tolist()) == ([7], [1])
    assert blocks.next([np.array([1, 2])], num_tokens=7, final=False) is None
    (local,), (remote,) = blocks.next([np.array([1, 2])], num_tokens=7, final=True)
    assert (local.tolist(), remote.tolist()) == ([8], [2]) and blocks.done


def test_an_ssm_state_is_read_once_after_the_final_commit():
    blocks = ProgressiveBlocks([[7, 8], [3]], [ATTN, SSM], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    chunk = blocks.next([np.array([1]), np.array([], np.int64)], num_tokens=4, final=False)
    assert chunk is not None and [a.tolist() for a in chunk[0]] == [[7], []]
    chunk = blocks.next([np.array([1, 2]), np.array([9])], num_tokens=8, final=True)
    assert chunk is not None
    assert [a.tolist() for a in chunk[0]] == [[8], [3]] and [a.tolist() for a in chunk[1]] == [[2], [9]]


def test_blocks_that_cannot_pair_are_refused_typed():
    # P committed more whole blocks than D named after its prefix: D's list is short.
    blocks = ProgressiveBlocks([[7]], [ATTN], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    with pytest.raises(InvalidArgument) as e:
        blocks.next([np.array([1, 2])], num_tokens=8, final=False)
    assert e.value.reason == "BLOCK_COUNT_MISMATCH" and e.value.metadata["local_blocks"] == "1"
    # D named more blocks than the final request has.
    blocks = ProgressiveBlocks([[7, 8, 9]], [ATTN], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    with pytest.raises(InvalidArgument) as e:
        blocks.next([np.array([1, 2])], num_tokens=8, final=True)
    assert e.value.reason == "BLOCK_COUNT_MISMATCH" and e.value.metadata["needed"] == "2"
    # A prefix that is not whole local blocks.
    with pytest.raises(InvalidArgument) as e:
        ProgressiveBlocks([[7]], [ATTN], prefix_tokens=6, local_block_size=4, remote_block_size=4)
    assert e.value.reason == "INVALID_FIELD" and e.value.metadata["field"] == "local_prefix_tokens"


def test_a_prefix_d_holds_is_skipped_whole_and_a_request_it_holds_entirely_reads_nothing():
    blocks = ProgressiveBlocks([[5]], [ATTN], prefix_tokens=8, local_block_size=4, remote_block_size=4)
    assert blocks.next([np.array([1, 2])], num_tokens=8, final=False) is None  # the prefix D holds
    (local,), (remote,) = blocks.next([np.array([1, 2, 3])], num_tokens=10, final=True)
    assert (local.tolist(), remote.tolist()) == ([5], [3])
    held = ProgressiveBlocks([[]], [ATTN], prefix_tokens=8, local_block_size=4, remote_block_size=4)
    assert held.next([np.array([1, 2])], num_tokens=8, final=True) is None and held.done
