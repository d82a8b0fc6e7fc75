"""Mamba state in padded pages (MambaSpec.page_size_bytes): a block's states back to back
at the start of a page, as vLLM's hybrid allocator pads a state page to its attention page.

The regions step by the page; a plan between a padded side and a packed one, or two padded
ones of other page sizes, reads every state whole into the same state of D's block. The
checks place the bytes from the formula (state s of block b at b * page + the bytes of the
states before it), not from the regions they check.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.errors import InvalidArgument
from kvsvc.layout import check_compatibility, simple_layout
from kvsvc.limits import MAX_STATE_PAGE_BYTES
from kvsvc.mapping import Side, plan_rank

STATES = [{"shape": [4, 6], "dtype": "bfloat16"}, {"shape": [8, 4], "dtype": "float32"}]  # model-level shapes


def hybrid(tp: int, page: int) -> Side:
    ssm = {"name": "ssm", "kind": "mamba", "num_layers": 2, "states": STATES, "page_size_bytes": page}
    return Side.of(simple_layout(tp_size=tp, kv_heads=4, num_layers=2, head_size=8, block_size=16, num_blocks=32,
                                 dtype="float32", extra_groups=[ssm]), tp)


def state_bytes(tp: int) -> list[int]:
    """Per state, one rank's bytes of one block (dimension 0 sharded)."""
    return [int(np.prod(s["shape"])) // tp * (2 if s["dtype"] == "bfloat16" else 4) for s in STATES]


def where(s: Side, layer: int, state: int, block: int, page: int) -> int:
    """Pool offset of a state of a block: from the layer's first state region, by the formula."""
    first = [r for r in s.pool.regions if r.is_ssm][layer * len(STATES)]
    lens = state_bytes(s.tp_size)
    step = page or lens[state]
    base = first.pool_offset if page else [r for r in s.pool.regions if r.is_ssm][layer * len(STATES) + state].pool_offset
    return base + block * step + (sum(lens[:state]) if page else 0)


def test_padded_regions_step_by_the_page_with_the_states_back_to_back():
    s = hybrid(1, 4096)
    ssm = [r for r in s.pool.regions if r.is_ssm]
    lens = state_bytes(1)
    assert [r.block_stride for r in ssm] == [4096] * 4
    assert [r.block_len for r in ssm] == lens * 2
    assert ssm[1].pool_offset - ssm[0].pool_offset == lens[0]  # the second state right after the first
    assert ssm[0].extent == 31 * 4096 + lens[0]


def test_the_page_travels_on_the_wire_and_is_checked():
    layout = hybrid(2, 8192).layout
    back = layout_from_proto(layout_to_proto(layout), tp_size=2)
    assert back == layout and back.groups[1].spec.page_bytes == 8192
    for bad in (sum(state_bytes(1)) - 1, MAX_STATE_PAGE_BYTES + 1):
        with pytest.raises(InvalidArgument) as e:
            hybrid(1, bad)
        assert any(v.field.endswith("page_size_bytes") for v in e.value.field_violations), e.value


@pytest.mark.parametrize(("d_tp", "d_page", "p_tp", "p_page"), [
    (1, 4096, 1, 0), (1, 0, 1, 4096), (1, 4096, 1, 1024), (2, 2048, 2, 0), (1, 4096, 2, 0), (2, 0, 1, 4096)])
def test_a_plan_reads_each_state_whole_into_the_same_state(d_tp, d_page, p_tp, p_page):
    rng = np.random.default_rng(0)
    p_sides = [hybrid(p_tp, p_page) for _ in range(p_tp)]
    p_mem = [rng.integers(0, 256, p_sides[0].pool.size_bytes, dtype=np.uint8) for _ in range(p_tp)]
    lids, rids = [[3, 5], [9]], [[20, 21], [17]]
    for d_rank in range(d_tp):
        d = hybrid(d_tp, d_page)
        d_mem = np.zeros(d.pool.size_bytes, np.uint8)
        plan = plan_rank(d, p_sides[0], d_rank, lids, rids)
        for r in plan.reads:
            cols = [np.asarray(a).tolist() for a in (r.local_region, r.local_offset, r.remote_region,
                                                    r.remote_offset, r.length)]
            for lr, lo, rr, ro, n in zip(*cols, strict=True):
                at = d.pool.regions[lr].pool_offset + lo
                src = p_sides[0].pool.regions[rr].pool_offset + ro
                d_mem[at:at + n] = p_mem[r.remote_rank][src:src + n]
        for layer in range(2):
            for st in range(len(STATES)):
                # The model's whole state of P's block, rank by rank (dimension 0 sharded), and D's slice of it.
                p_len = state_bytes(p_tp)[st]
                whole = np.concatenate([p_mem[k][where(p_sides[0], layer, st, 17, p_page):][:p_len]
                                        for k in range(p_tp)])
                d_len = state_bytes(d_tp)[st]
                mine = whole[d_rank * d_len:(d_rank + 1) * d_len]
                at = where(d, layer, st, 9, d_page)
                assert np.array_equal(d_mem[at:at + d_len], mine), (layer, st)


def test_a_state_kept_transposed_on_one_side_is_refused_not_read():
    # vLLM keeps the conv state [state, dim] (SD) or [dim, state] (DS) as its CPU's features or
    # the connector decide: the same bytes, read as the other, would be a silently wrong state.
    def side(conv: list[int]) -> Side:
        ssm = {"name": "ssm", "kind": "mamba", "num_layers": 1, "page_size_bytes": 65536,
               "states": [{"shape": conv, "dtype": "bfloat16"}, {"shape": [8, 32, 16], "dtype": "float32"}]}
        return Side.of(simple_layout(tp_size=1, kv_heads=2, num_layers=1, head_size=8, extra_groups=[ssm]), 1)

    sd, ds = side([3, 288]), side([288, 3])
    found = check_compatibility(sd.layout, 1, ds.layout, 1)
    assert [v.reason for v in found] == ["SSM_SHAPE_MISMATCH"], found
    assert not check_compatibility(sd.layout, 1, side([3, 288]).layout, 1)
