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
from kvsvc.mapping.progressive import Chunk, GroupShape, Partial, ProgressiveBlocks

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


def whole(chunks: list[Chunk]) -> Chunk | None:
    """The one set of blocks an answer hands out in every layer (None: nothing)."""
    if not chunks:
        return None
    (chunk,) = chunks
    assert chunk.layers is None
    return chunk


def stream(blocks: ProgressiveBlocks, commits: list[tuple[int, int, bool]], p_blocks: list[int],
           remote_bs: int) -> list[tuple[int, list[int], int, int]]:
    """Feed commits (blocks committed, tokens committed, final); every handed-out local block
    with its P blocks, and what was committed when it was handed out."""
    got = []
    for n_blocks, tokens, final in commits:
        chunk = whole(blocks.next([np.array(p_blocks[:n_blocks])], num_tokens=tokens, final=final))
        if chunk is None:
            continue
        (local,), (remote,), _ = chunk
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
    (local,), (remote,), _ = whole(blocks.next([np.array([1, 2])], num_tokens=6, final=False))
    assert (local.tolist(), remote.tolist()) == ([7], [1])
    assert blocks.next([np.array([1, 2])], num_tokens=7, final=False) == []
    (local,), (remote,), _ = whole(blocks.next([np.array([1, 2])], num_tokens=7, final=True))
    assert (local.tolist(), remote.tolist()) == ([8], [2]) and blocks.done


def test_an_ssm_state_is_read_once_after_the_final_commit():
    blocks = ProgressiveBlocks([[7, 8], [3]], [ATTN, SSM], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    chunk = whole(blocks.next([np.array([1]), np.array([], np.int64)], num_tokens=4, final=False))
    assert chunk is not None and [a.tolist() for a in chunk[0]] == [[7], []]
    chunk = whole(blocks.next([np.array([1, 2]), np.array([9])], num_tokens=8, final=True))
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
    assert blocks.next([np.array([1, 2])], num_tokens=8, final=False) == []  # the prefix D holds
    (local,), (remote,), _ = whole(blocks.next([np.array([1, 2, 3])], num_tokens=10, final=True))
    assert (local.tolist(), remote.tolist()) == ([5], [3])
    held = ProgressiveBlocks([[]], [ATTN], prefix_tokens=8, local_block_size=4, remote_block_size=4)
    assert held.next([np.array([1, 2])], num_tokens=8, final=True) == [] and held.done


# ---- a chunk committed layer by layer ---------------------------------------------------

def layered_commits(rng: random.Random, num_tokens: int, remote_bs: int, layers: int) -> list[tuple[int, int, bool, Partial | None]]:
    """What D hears as P commits chunks of any size, some of them layer by layer (as an
    engine that commits each layer group after its attention): (blocks committed, tokens,
    final, the partial chunk). P commits the blocks its tokens reach (the last one partly
    filled until the next chunk), as vLLM's blocks are."""
    out: list[tuple[int, int, bool, Partial | None]] = []
    tokens = 0
    while tokens < num_tokens:
        done = min(num_tokens, tokens + rng.randint(1, 64))
        blocks = -(-done // remote_bs)
        if rng.random() < 0.6:  # this chunk layer by layer: its blocks join with its first commit
            whole_blocks = -(-tokens // remote_bs)
            k = 0
            while True:
                k = rng.randint(k, layers - 1) if k < layers - 1 else k
                out.append((blocks, done, False, Partial((whole_blocks,), tokens, (k,))))
                if k == layers - 1 or rng.random() < 0.3:
                    break
        tokens = done
        out.append((blocks, done, done == num_tokens, None))
    return out


def written(first: int, last: int, layer: int, tokens: int, partial: Partial | None) -> bool:
    """Whether P wrote tokens [first, last) in layer `layer` (the checker's own reading of a
    partial chunk: every layer up to whole_tokens, its first layers up to tokens)."""
    if partial is None:
        return last <= tokens
    return last <= partial.whole_tokens or (layer < partial.layers[0] and last <= tokens)


@pytest.mark.parametrize("seed", range(60))
def test_a_chunk_committed_layer_by_layer_is_read_once_per_layer_and_only_once_written(seed):
    rng = random.Random(seed)
    layers = rng.choice([1, 2, 4, 7])
    remote_bs = rng.choice([1, 4, 16])
    ratio = rng.choice([1, 1, 2, 4])
    local_bs = remote_bs * ratio
    num_tokens = rng.randint(1, 300)
    prefix_tokens = local_bs * rng.randint(0, (num_tokens - 1) // local_bs)
    p_blocks = rng.sample(range(1000), -(-num_tokens // remote_bs))
    local = rng.sample(range(1000), -(-(num_tokens - prefix_tokens) // local_bs))
    blocks = ProgressiveBlocks([local], [ATTN], prefix_tokens=prefix_tokens, local_block_size=local_bs,
                               remote_block_size=remote_bs)
    want = dict(expected_pairs(local, p_blocks, prefix_tokens, local_bs, remote_bs, num_tokens))
    seen: dict[tuple[int, int], int] = {}
    for n_blocks, tokens, final, partial in layered_commits(rng, num_tokens, remote_bs, layers):
        for (lids,), (rids,), span in blocks.next([np.array(p_blocks[:n_blocks])], num_tokens=tokens, final=final,
                                                   partial=partial):
            a, b = (0, layers) if span is None else (span[0], layers if span[1] is None else span[1])
            rids = rids.tolist()
            for j, lb in enumerate(lids.tolist()):
                assert rids[j * ratio:(j + 1) * ratio] == want[lb][:len(rids[j * ratio:(j + 1) * ratio])]
                first = prefix_tokens + local.index(lb) * local_bs
                last = min(first + local_bs, num_tokens) if final else first + local_bs
                for layer in range(a, b):
                    assert final or written(first, last, layer, tokens, partial), (lb, layer, tokens, partial)
                    seen[lb, layer] = seen.get((lb, layer), 0) + 1
    assert blocks.done
    assert seen == {(lb, layer): 1 for lb in local for layer in range(layers)}


def test_layers_of_a_partial_chunk_are_read_as_they_are_written_then_the_rest_once_whole():
    blocks = ProgressiveBlocks([[7, 8, 9]], [ATTN], prefix_tokens=0, local_block_size=4, remote_block_size=4)
    assert [c.layers for c in blocks.next([np.array([1])], num_tokens=4, final=False)] == [None]
    # The next chunk (blocks 2 and 3) written in layer 0 of 4: both read in that layer only.
    (chunk,) = blocks.next([np.array([1, 2, 3])], num_tokens=12, final=False, partial=Partial((1,), 4, (1,)))
    assert chunk.layers == (0, 1) and chunk.local[0].tolist() == [8, 9] and chunk.remote[0].tolist() == [2, 3]
    assert blocks.next([np.array([1, 2, 3])], num_tokens=12, final=False, partial=Partial((1,), 4, (1,))) == []
    (chunk,) = blocks.next([np.array([1, 2, 3])], num_tokens=12, final=False, partial=Partial((1,), 4, (3,)))
    assert chunk.layers == (1, 3) and chunk.local[0].tolist() == [8, 9]
    (chunk,) = blocks.next([np.array([1, 2, 3])], num_tokens=12, final=True)
    assert chunk.layers == (3, None) and chunk.remote[0].tolist() == [2, 3] and blocks.done
