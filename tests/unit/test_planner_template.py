"""The one-block plan template (planner._one_block_template): a request whose every group
reads one block is planned by moving a cached plan of block 0, and must come out read for
read what the full planner computes for those blocks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvsvc.errors import KvsvcError
from kvsvc.layout import simple_layout
from kvsvc.mapping import Side, plan_rank, planner

SSM = {"name": "ssm", "kind": "mamba", "num_layers": 1, "states": [{"shape": [16, 2]}, {"shape": [16, 4]}]}
SWA = {"name": "swa", "kind": "sliding_window", "num_layers": 2, "sliding_window": 64}


def side(tp: int, k: int, mla: bool, extra: list[dict], region_layout: str, memory_layout: str, nb: int) -> Side:
    return Side.of(simple_layout(tp_size=tp, kv_heads=k, num_layers=3, head_size=4, block_size=16, num_blocks=nb,
                                 mla=mla, dtype="float32", extra_groups=extra, region_layout=region_layout,
                                 kv_memory_layout=memory_layout), tp)


def full_plan(local: Side, remote: Side, rank: int, lids: list[list[int]], rids: list[list[int]]) -> list[tuple]:
    """The full planner's reads (the template bypassed), as plain lists."""
    planner.validate_pair(local, remote)
    blocks = planner.prepare_blocks(local, remote, lids, rids)
    reads = planner._plan_reads(local, remote, rank, planner._rank_work(local, remote, rank), blocks)
    return [as_lists(r) for r in reads]


def as_lists(r) -> tuple:
    return (r.remote_rank, *(np.asarray(a).tolist() for a in (r.local_region, r.local_offset, r.remote_region,
                                                              r.remote_offset, r.length)))


CASES = [(lt, rt, k, mla, extra, rl, ml)
         for lt, rt, k, mla, extra, rl, ml in itertools.product(
             [1, 2, 4], [1, 2, 4, 8], [1, 2, 8], [False, True], [[], [SSM], [SWA]],
             ["split_kv", "blocks_first"], ["HND", "NHD"])
         if not (mla and ml == "NHD")]


@pytest.mark.parametrize("lt,rt,k,mla,extra,rl,ml", CASES)
def test_one_block_requests_plan_as_the_full_planner_does(lt, rt, k, mla, extra, rl, ml) -> None:
    try:
        local = side(lt, k, mla, extra, rl, ml, 64)
        remote = side(rt, k, mla, extra, "split_kv", "HND", 128)
    except KvsvcError:
        pytest.skip("not a valid layout pair")
    rng = np.random.default_rng(lt * 1000 + rt * 100 + k)
    groups = len(local.layout.groups)
    for _ in range(3):
        lids = [[int(rng.integers(64))] for _ in range(groups)]
        rids = [[int(rng.integers(128))] for _ in range(groups)]
        for rank in range(lt):
            try:
                plan = plan_rank(local, remote, rank, lids, rids)
            except KvsvcError as e:
                with pytest.raises(KvsvcError) as again:
                    full_plan(local, remote, rank, lids, rids)
                assert again.value.reason == e.reason
                continue
            assert [as_lists(r) for r in plan.reads] == full_plan(local, remote, rank, lids, rids)


def test_the_template_is_used_only_for_one_block_per_group_and_never_changes() -> None:
    local, remote = side(2, 8, False, [SSM], "split_kv", "HND", 64), side(4, 8, False, [SSM], "split_kv", "HND", 128)
    planner._one_block_template.cache_clear()
    plan_rank(local, remote, 0, [[1, 2], [3]], [[5, 6], [7]])  # two blocks in one group: the full planner
    assert planner._one_block_template.cache_info().currsize == 0
    first = plan_rank(local, remote, 0, [[9], [3]], [[17], [7]])
    assert planner._one_block_template.cache_info().currsize == 1
    for r in first.reads:  # what a plan hands out cannot be written into the template through it
        assert not r.local_region.flags.writeable
        with pytest.raises(ValueError):
            r.length[0] = 0
    again = plan_rank(local, remote, 0, [[9], [3]], [[17], [7]])
    assert [as_lists(r) for r in again.reads] == [as_lists(r) for r in first.reads]
    assert [as_lists(r) for r in first.reads] == full_plan(local, remote, 0, [[9], [3]], [[17], [7]])


def test_a_prefix_hit_reads_the_last_remote_block_through_the_template() -> None:
    # One local block for three remote ones (the first two already held locally): the
    # template moves to the third remote block, as the full planner trims to it.
    local, remote = side(1, 8, False, [SWA], "split_kv", "HND", 64), side(2, 8, False, [SWA], "split_kv", "HND", 128)
    lids, rids = [[5], [6]], [[40, 41, 42], [43]]
    plan = plan_rank(local, remote, 0, lids, rids)
    assert plan.prefix_blocks_skipped == (2, 0)
    assert [as_lists(r) for r in plan.reads] == full_plan(local, remote, 0, lids, rids)
    moved = plan_rank(local, remote, 0, [[5], [6]], [[42], [43]])
    assert [as_lists(r) for r in moved.reads] == [as_lists(r) for r in plan.reads]
