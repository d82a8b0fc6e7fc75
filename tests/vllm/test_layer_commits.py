"""P's last chunk of a streamed prompt committed layer by layer (integrations/vllm/layer_commits.py):
which partial commits a step's saved layers make, and the final commit after them."""

from __future__ import annotations

import pytest

from kvsvc.integrations.vllm.layer_commits import LayerCommits
from kvsvc.integrations.vllm.metadata import Commit

LAYERS = [f"model.layers.{i}.attn" for i in range(8)]


def commit(epoch: int, final: bool, blocks=((5, 6),)) -> Commit:
    return Commit("lease", "t" * 32, epoch, [list(b) for b in blocks], 96, final, 0)


def run(lc: LayerCommits, commits: dict[str, Commit], order=LAYERS):
    made = [m for name in order for m in lc.saved(name, commits)]
    return made, lc.ended(commits)


def test_the_final_chunk_is_committed_in_parts_then_made_whole_after_them():
    lc = LayerCommits([LAYERS], parts=4)
    made, ended = run(lc, {"a": commit(3, True), "b": commit(2, False)})
    # Every 2 of 8 layers, the final chunk only: blocks with the first, then the counts alone.
    assert [(m.request_id, m.commit.epoch, m.commit.block_ids, m.layers_done) for m in made] == [
        ("a", 3, [[5, 6]], (2,)), ("a", 4, [[]], (4,)), ("a", 5, [[]], (6,))]
    assert not any(m.commit.final for m in made)
    assert (ended["a"].epoch, ended["a"].block_ids, ended["a"].final) == (6, [[]], True)
    assert ended["b"] == commit(2, False)  # a chunk that does not complete its prompt: as it was
    # The next step starts afresh.
    made, ended = run(lc, {"c": commit(4, True)})
    assert [m.commit.epoch for m in made] == [4, 5, 6] and ended["c"].epoch == 7


@pytest.mark.parametrize("parts", [0, 1])
def test_no_parts_leaves_every_commit_whole(parts):
    lc = LayerCommits([LAYERS], parts=parts)
    made, ended = run(lc, {"a": commit(3, True)})
    assert made == [] and ended == {"a": commit(3, True)}


def test_counts_are_each_groups_prefix_of_its_layers_saved():
    # Two groups, layers saved interleaved and one out of order: a group's count is how many
    # of its first layers were saved (a later one saved first does not count yet).
    g0, g1 = ["a0", "a1", "a2"], ["b0", "b1", "b2"]
    lc = LayerCommits([g0, g1], parts=3)
    made, ended = run(lc, {"r": commit(2, True, ((1,), (2,)))}, ["a0", "b1", "a1", "b0", "a2", "b2"])
    assert [m.layers_done for m in made] == [(1, 0), (2, 2)]  # b1 before b0: group 1 holds none yet
    assert ended["r"].epoch == 4
    # Layers the groups do not name (another connector's, a layer saved twice) count nothing.
    made, _ = run(lc, {"r": commit(2, True, ((1,), (2,)))}, ["x", "a0", "a0", "b0"])
    assert [m.layers_done for m in made] == [(1, 1)]


def test_a_step_without_a_final_commit_makes_none():
    lc = LayerCommits([LAYERS], parts=8)
    made, ended = run(lc, {"a": commit(1, False), "b": commit(2, False)})
    assert made == [] and ended == {"a": commit(1, False), "b": commit(2, False)}
