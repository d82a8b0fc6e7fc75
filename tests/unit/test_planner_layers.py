"""Plans of some layers only (a chunk committed layer by layer, mapping/progressive.py):
every read of such a plan is of a region of those layers, and the plans of ranges that
split a group's layers read, together, exactly what the plan of every layer reads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvsvc.errors import KvsvcError
from kvsvc.layout import simple_layout
from kvsvc.mapping import Side, plan_rank

SWA = {"name": "swa", "kind": "sliding_window", "num_layers": 2, "sliding_window": 64}
SSM = {"name": "ssm", "kind": "mamba", "num_layers": 1, "states": [{"shape": [16, 2]}]}


def side(tp: int, mla: bool, extra: list[dict], block: int, region_layout: str) -> Side:
    return Side.of(simple_layout(tp_size=tp, kv_heads=4, num_layers=5, head_size=4, block_size=block, num_blocks=64,
                                 mla=mla, dtype="float32", extra_groups=extra, region_layout=region_layout), tp)


def rows(plan) -> set[tuple[int, ...]]:
    """Every read of a plan, one row per descriptor."""
    out = set()
    for r in plan.reads:
        cols = [np.asarray(a).tolist() for a in (r.local_region, r.local_offset, r.remote_region, r.remote_offset,
                                                r.length)]
        out.update((r.remote_rank, *row) for row in zip(*cols, strict=True))
    return out


def place_of(s: Side) -> dict[int, int]:
    """Region index -> its layer's place in its group, from the layout's own layer order."""
    names = [[n for n, _ in g.layers()] for g in s.layout.groups]
    return {r.index: names[r.group_index].index(r.layer_name) for r in s.pool.regions}


@pytest.mark.parametrize(("lt", "rt", "mla", "extra", "ratio", "region_layout"), [
    (lt, rt, mla, extra, ratio, rl) for lt, rt, mla, extra, ratio, rl in itertools.product(
        [1, 2], [1, 2, 4], [False, True], [[], [SWA], [SSM]], [1, 2], ["split_kv", "blocks_first"])])
def test_plans_of_layer_ranges_read_those_layers_and_together_every_layer(lt, rt, mla, extra, ratio, region_layout):
    try:
        local = side(lt, mla, extra, 16 * ratio, region_layout)
        remote = side(rt, mla, extra, 16, "split_kv")
    except KvsvcError:
        pytest.skip("not a valid layout pair")
    groups = len(local.layout.groups)
    lids = [[3, 9] if g == 0 else [5] for g in range(groups)]
    rids = [[10, 11, 40, 41][:2 * ratio] if g == 0 else [7] for g in range(groups)]
    places = place_of(local)
    for rank in range(lt):
        every = rows(plan_rank(local, remote, rank, lids, rids))
        assert every
        for cuts in ([(0, 1), (1, None)], [(0, 2), (2, 3), (3, None)], [(0, 5), (5, None)]):
            parts = [rows(plan_rank(local, remote, rank, lids, rids, layers=c)) for c in cuts]
            for (a, b), part in zip(cuts, parts, strict=True):
                assert all(a <= places[row[1]] and (b is None or places[row[1]] < b) for row in part), (a, b)
            assert sum(len(p) for p in parts) == len(every) and set().union(*parts) == every


def test_one_block_requests_read_only_their_layers_too():
    # (a request with one block per group otherwise takes the cached one-block template)
    s = side(1, False, [], 16, "split_kv")
    places = place_of(s)
    part = rows(plan_rank(s, s, 0, [[3]], [[4]], layers=(2, 4)))
    assert part and {places[row[1]] for row in part} == {2, 3}
