"""Descriptor geometry: the bytes a plan moves, checked against an independent reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.layout import simple_layout
from kvsvc.mapping import Side, plan_rank
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.verify import RankMemory, check_rank, fill_rank
from tests.simulate import apply_plan

TP = [1, 2, 4, 8, 16]
K = [1, 2, 4, 8, 16, 32]
SSM_GROUP = {"name": "ssm", "kind": "mamba", "num_layers": 1, "states": [{"shape": [16, 2]}, {"shape": [16, 4]}]}


def make_side(tp: int, *, k: int, mla: bool, ssm: bool, block: int, nb: int, layers: int = 1,
              region_layout: str = "split_kv", kv_memory_layout: str = "HND") -> Side:
    lay = simple_layout(tp_size=tp, kv_heads=k, num_layers=layers, head_size=2, block_size=block, num_blocks=nb,
                        mla=mla, dtype="float32", extra_groups=[SSM_GROUP] if ssm else [],
                        region_layout=region_layout, kv_memory_layout=kv_memory_layout)
    return Side.of(lay, tp)


def memory(side: Side) -> RankMemory:
    return RankMemory(side.pool.regions, np.zeros(side.pool.size_bytes, np.uint8))


def run_transfer(local: Side, remote: Side, local_ids, remote_ids, first_position=None):
    """Plan every local rank, apply the ranges, and return (plans, errors per rank)."""
    k = local.layout.total_num_kv_heads
    remotes = {}
    for r in range(remote.tp_size):
        remotes[r] = memory(remote)
        fill_rank(remotes[r], r, remote.tp_size, k, remote_ids, remote.layout.block_size)
    plans, errors = [], {}
    for t in range(local.tp_size):
        plan = plan_rank(local, remote, t, local_ids, remote_ids)
        mem = memory(local)
        apply_plan(plan, mem, remotes)
        plans.append(plan)
        errs = check_rank(mem, t, local.tp_size, k, local_ids, local.layout.block_size, first_position)
        if errs:
            errors[t] = errs[:3]
    return plans, errors


def expected_bytes(side: Side, local_ids) -> int:
    return sum(r.block_len * len(local_ids[r.group_index]) for r in side.pool.regions)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lt=st.sampled_from(TP), rt=st.sampled_from(TP), k=st.sampled_from(K), mla=st.booleans(), ssm=st.booleans(),
       n=st.sampled_from([1, 2]), m=st.integers(1, 4), prefix=st.integers(0, 2), layers=st.integers(1, 3),
       orders=st.sampled_from([("HND", "HND"), ("NHD", "NHD"), ("HND", "NHD"), ("NHD", "HND")]), data=st.data())
def test_every_rank_gets_exactly_its_heads(lt, rt, k, mla, ssm, n, m, prefix, layers, orders, data):
    # Several layers: the planner computes one region per shape and repeats it over the others.
    # Any pair of memory orders at any TP pair: NHD with heads split and mixed orders read token rows.
    nb = 12
    lo, ro = ("HND", "HND") if mla else orders
    remote = make_side(rt, k=k, mla=mla, ssm=ssm, block=2, nb=nb * 2, layers=layers, kv_memory_layout=ro)
    local = make_side(lt, k=k, mla=mla, ssm=ssm, block=2 * n, nb=nb, layers=layers, kv_memory_layout=lo)
    total_local = m + prefix
    rids = data.draw(st.permutations(range(nb * 2)))[: total_local * n]
    lids = data.draw(st.permutations(range(nb)))[:m]
    local_ids, remote_ids = [lids], [rids]
    first = [prefix]
    if ssm:  # SSM state pairs block for block, no prefix skipping
        s_l = data.draw(st.permutations(range(nb)))[:2]
        s_r = data.draw(st.permutations(range(nb * 2)))[:2]
        local_ids.append(s_l)
        remote_ids.append(s_r)
        first.append(0)
    plans, errors = run_transfer(local, remote, local_ids, remote_ids, first)
    assert not errors, errors
    for plan in plans:
        targets = set(handshake_target_ranks(plan.local_rank, lt, rt))
        assert set(plan.mapping.all_source_ranks) <= targets
        assert {r.remote_rank for r in plan.reads} <= targets
        attn = plan.mapping.source_ranks_per_group[0]
        slots = [plan.mapping.rank_to_attention_slot[r] for r in attn]
        assert len(set(slots)) == len(slots)
        assert plan.nbytes == expected_bytes(local, local_ids)
        assert plan.prefix_blocks_skipped[0] == prefix
        _assert_disjoint_local_ranges(plan)


def _assert_disjoint_local_ranges(plan):
    starts, ends = [], []
    for reads in plan.reads:
        assert np.all(np.diff(reads.local_region) >= 0), "reads are not region-major"
        assert np.array_equal(reads.local_region, reads.remote_region), "local region i reads remote region i"
        starts.append(reads.local_region.astype(np.int64) * 2**40 + reads.local_offset)
        ends.append(reads.local_region.astype(np.int64) * 2**40 + reads.local_offset + reads.length)
        assert np.all(reads.length > 0)
    s, e = np.concatenate(starts), np.concatenate(ends)
    order = np.argsort(s)
    assert np.all(s[order][1:] >= e[order][:-1]), "two reads write the same local bytes"


def test_byte_example_d_gt_p():
    # MAPPING.md §9: L=2, R=1, K=8, head 128, block 16, bf16: P K block is 32768 bytes.
    remote = Side.of(simple_layout(tp_size=1, kv_heads=8, head_size=128, num_layers=1), 1)
    local = Side.of(simple_layout(tp_size=2, kv_heads=8, head_size=128, num_layers=1), 2)
    assert remote.pool.regions[0].block_len == 32768
    for t, want in ((0, 0), (1, 16384)):
        plan = plan_rank(local, remote, t, [[0]], [[0]])
        (reads,) = plan.reads
        key = reads.remote_region == 0
        assert reads.remote_offset[key].tolist() == [want]
        assert reads.length[key].tolist() == [16384]


@pytest.mark.parametrize(("lt", "rt", "k"), [(1, 1, 8), (2, 2, 4), (1, 2, 8), (2, 1, 8), (4, 4, 1)])
@pytest.mark.parametrize("region_layout", ["split_kv", "blocks_first"])
def test_region_layouts_interoperate(lt, rt, k, region_layout):
    other = "blocks_first" if region_layout == "split_kv" else "split_kv"
    local = make_side(lt, k=k, mla=False, ssm=False, block=2, nb=8, layers=2, region_layout=region_layout)
    remote = make_side(rt, k=k, mla=False, ssm=False, block=2, nb=8, layers=2, region_layout=other)
    _, errors = run_transfer(local, remote, [[3, 1, 2]], [[5, 6, 0]])
    assert not errors, errors


def test_nhd_equal_tp_with_block_ratio():
    local = make_side(2, k=8, mla=False, ssm=False, block=4, nb=8, kv_memory_layout="NHD")
    remote = make_side(2, k=8, mla=False, ssm=False, block=2, nb=8, kv_memory_layout="NHD")
    plans, errors = run_transfer(local, remote, [[1, 2]], [[3, 4, 6, 7]])
    assert not errors, errors
    # Remote blocks 3,4 (and 6,7) are consecutive: one descriptor per (region, local block).
    assert plans[0].num_descriptors == len(local.pool.regions) * 2


def test_coalescing_merges_contiguous_runs():
    local = make_side(2, k=8, mla=False, ssm=False, block=2, nb=64, layers=2)
    remote = make_side(2, k=8, mla=False, ssm=False, block=2, nb=64, layers=2)
    plan = plan_rank(local, remote, 0, [list(range(10, 30))], [list(range(40, 60))])
    # Equal TP, consecutive ids on both sides: one descriptor per region.
    assert plan.num_descriptors == len(local.pool.regions)


def test_heads_split_descriptor_bound():
    # D > P: half of each P block, so one descriptor per (region, block) at most.
    local = make_side(4, k=8, mla=False, ssm=False, block=2, nb=64, layers=2)
    remote = make_side(2, k=8, mla=False, ssm=False, block=2, nb=64, layers=2)
    plan = plan_rank(local, remote, 1, [list(range(20))], [list(range(20))])
    assert plan.num_descriptors == len(local.pool.regions) * 20


def test_partial_last_local_block():
    # Local blocks hold 2 remote blocks; the request's last local block is half full.
    local = make_side(1, k=4, mla=False, ssm=False, block=4, nb=8)
    remote = make_side(1, k=4, mla=False, ssm=False, block=2, nb=8)
    plan = plan_rank(local, remote, 0, [[5, 6]], [[1, 2, 3]])
    assert plan.nbytes == sum(r.block_len for r in local.pool.regions) * 3 // 2


def test_bad_block_ids():
    side = make_side(1, k=4, mla=False, ssm=False, block=2, nb=8)
    with pytest.raises(InvalidArgument) as e:
        plan_rank(side, side, 0, [[0, 8]], [[0, 1]])
    assert e.value.reason == "BLOCK_OUT_OF_RANGE"
    assert e.value.metadata["block_id"] == "8"
    with pytest.raises(InvalidArgument) as e:
        plan_rank(side, side, 0, [[1, 1]], [[0, 2]])
    assert e.value.reason == "DUPLICATE_BLOCK_ID"
    with pytest.raises(InvalidArgument) as e:
        plan_rank(side, side, 0, [[1, 2, 3]], [[0, 2]])
    assert e.value.reason == "BLOCK_COUNT_MISMATCH"
    with pytest.raises(InvalidArgument) as e:
        plan_rank(side, side, 0, [[1], [2]], [[0], [1]])
    assert e.value.reason == "UNKNOWN_GROUP"


@pytest.mark.parametrize(("lt", "rt", "k", "lo", "ro", "descriptors"), [
    # D TP 2 reads half the heads of P TP 1's NHD block: one run of 4 heads per token (4 tokens).
    (2, 1, 8, "NHD", "NHD", 4),
    # D TP 1 fills each token's 8 heads from two P ranks: per P rank one run per token.
    (1, 2, 8, "NHD", "NHD", 8),
    # Equal TP, different orders: a head of a token at a time (4 heads x 4 tokens).
    (2, 2, 8, "HND", "NHD", 16),
    (2, 2, 8, "NHD", "HND", 16),
])
def test_token_rows_where_heads_are_not_contiguous(lt, rt, k, lo, ro, descriptors):
    """Heads split over NHD blocks, or blocks in different orders: right bytes, token-row descriptors."""
    local = make_side(lt, k=k, mla=False, ssm=False, block=4, nb=8, kv_memory_layout=lo)
    remote = make_side(rt, k=k, mla=False, ssm=False, block=4, nb=8, kv_memory_layout=ro)
    plans, errors = run_transfer(local, remote, [[5]], [[2]])
    assert not errors, errors
    per_region = plans[0].num_descriptors // len(local.pool.regions)
    assert per_region == descriptors


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lt=st.sampled_from([1, 2, 4, 8]), rt=st.sampled_from([1, 2, 4, 8]), k=st.sampled_from([1, 2, 4, 8]),
       n=st.sampled_from([1, 2]), nhd=st.booleans(), data=st.data())
def test_packed_kv_moves_whole_token_rows(lt, rt, k, n, nhd, data):
    """vLLM's CPU layout: one region per layer, K and V of a token packed inside each head
    (in NHD, each head's K and V of a token packed inside the token's row)."""
    layout = "NHD" if nhd else "HND"
    remote = make_side(rt, k=k, mla=False, ssm=False, block=2, nb=16, layers=2, region_layout="packed_kv",
                       kv_memory_layout=layout)
    local = make_side(lt, k=k, mla=False, ssm=False, block=2 * n, nb=8, layers=2, region_layout="packed_kv",
                      kv_memory_layout=layout)
    assert len(local.pool.regions) == 2 and {r.kind.value for r in local.pool.regions} == {"kv"}
    lids = data.draw(st.permutations(range(8)))[:3]
    rids = data.draw(st.permutations(range(16)))[:3 * n]
    _, errors = run_transfer(local, remote, [lids], [rids])
    assert not errors, errors


@pytest.mark.parametrize("other", ["split_kv", "blocks_first"])
def test_packed_kv_does_not_mix_with_separate_k_and_v(other):
    local = make_side(2, k=4, mla=False, ssm=False, block=2, nb=8, region_layout="packed_kv")
    remote = make_side(2, k=4, mla=False, ssm=False, block=2, nb=8, region_layout=other)
    with pytest.raises(FailedPrecondition) as e:
        plan_rank(local, remote, 0, [[1]], [[1]])
    assert "REGION_LAYOUT_MISMATCH" in e.value.metadata["violations"]
