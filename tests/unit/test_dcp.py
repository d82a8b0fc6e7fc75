"""DCP-sharded MLA (MAPPING.md §9): sources, release counts and bytes against the reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.layout import simple_layout
from kvsvc.mapping import ReleaseTracker, Side, expected_notifiers, plan_rank, prepare_blocks
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.verify import RankMemory, check_rank, fill_rank
from tests.simulate import apply_plan

BLOCK = 2
SSM_GROUP = {"name": "ssm", "kind": "mamba", "num_layers": 1, "states": [{"shape": [16, 2]}]}
# (TP, DCP) of one engine: DCP is 1 or the TP size.
ENGINES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4), (8, 1), (8, 8)]


def mla_side(tp: int, dcp: int, *, nb: int = 40, layers: int = 2, block: int = BLOCK, ssm: bool = False) -> Side:
    lay = simple_layout(tp_size=tp, kv_heads=1, num_layers=layers, head_size=4, block_size=block, num_blocks=nb,
                        mla=True, dtype="float32", dcp_size=dcp, extra_groups=[SSM_GROUP] if ssm else [])
    return Side.of(lay, tp)


def memory(side: Side) -> RankMemory:
    return RankMemory(side.pool.regions, np.zeros(side.pool.size_bytes, np.uint8))


def consumers(lt: int, lc: int, rt: int, rd: int) -> int:
    """vLLM 0.32's count of D ranks a P rank waits for, as its docs state it."""
    if rd > 1:
        return lt if lc == 1 else max(1, lc // rd)
    return max(1, lt // rt)


# ---- sources and counts, the worked examples ----------------------------------------


def test_examples_of_vllm():
    # D TP4/DCP1 <- P TP4/DCP4: every D rank reads all 4 P ranks, each P rank waits for 4.
    assert [handshake_target_ranks(t, 4, 4, 1, 4) for t in range(4)] == [[0, 1, 2, 3]] * 4
    assert [len(expected_notifiers(p, 4, 4, 1, 4)) for p in range(4)] == [4] * 4
    # D TP2/DCP2 <- P TP4/DCP4: D rank 1 reads P1 and P3, count 1.
    assert handshake_target_ranks(1, 2, 4, 2, 4) == [1, 3]
    assert expected_notifiers(3, 2, 4, 2, 4) == {1}
    # D TP4/DCP4 <- P TP2/DCP2: D rank 3 reads P1, count 2.
    assert handshake_target_ranks(3, 4, 2, 4, 2) == [1]
    assert expected_notifiers(1, 4, 2, 4, 2) == {1, 3}


@pytest.mark.parametrize("d", ENGINES)
@pytest.mark.parametrize("p", ENGINES)
def test_release_counts_follow_the_targets(d, p):
    (lt, lc), (rt, rd) = d, p
    if lt % rt and rt % lt:
        pytest.skip("TP sizes must divide")
    for r in range(rt):
        owed = expected_notifiers(r, lt, rt, lc, rd)
        assert owed == {t for t in range(lt) if r in handshake_target_ranks(t, lt, rt, lc, rd)}
        assert len(owed) == consumers(lt, lc, rt, rd) or (rd == 1 and rt > lt)


def test_release_tracker_frees_each_p_rank_when_its_readers_are_done():
    tracker = ReleaseTracker([0, 1, 2, 3], 2, 4, 2, 4)  # D TP2/DCP2 <- P TP4/DCP4
    assert tracker.notify([0]) == [0, 2] and not tracker.done
    assert tracker.notify([1]) == [1, 3] and tracker.done
    tracker = ReleaseTracker([1], 4, 2, 4, 2)  # D TP4/DCP4 <- P TP2/DCP2: P1 waits for D1 and D3
    assert tracker.notify([0, 1, 2]) == [] and tracker.pending_d_ranks == [3]
    assert tracker.notify([3]) == [1]


# ---- bytes -----------------------------------------------------------------------------


def run(local: Side, remote: Side, num_tokens: int, computed: int, rng: np.random.Generator):
    """Fill P's ranks, plan and apply every D rank, and return (plans, errors, untouched-violations)."""
    lc, rd = local.layout.dcp_size, remote.layout.dcp_size
    total = -(-num_tokens // BLOCK)
    r_ids = [rng.permutation(remote.layout.num_blocks)[: -(-total // rd) + rng.integers(0, 2)].tolist()]
    l_all = rng.permutation(local.layout.num_blocks)[: -(-total // lc)].tolist()
    l_ids = [l_all[computed:]]
    remotes = {}
    for r in range(remote.tp_size):
        remotes[r] = memory(remote)
        fill_rank(remotes[r], r, remote.tp_size, 1, r_ids, BLOCK, dcp_size=rd)
    blocks = prepare_blocks(local, remote, l_ids, r_ids, num_tokens)
    plans, errors, stray = [], {}, []
    for t in range(local.tp_size):
        plan = plan_rank(local, remote, t, validated=True, blocks=blocks)
        mem = memory(local)
        apply_plan(plan, mem, remotes)
        plans.append(plan)
        errs = check_rank(mem, t, local.tp_size, 1, l_ids, BLOCK, [computed], dcp_size=lc, num_tokens=num_tokens)
        if errs:
            errors[t] = errs[:3]
        for pos, b in enumerate(l_ids[0], start=computed):
            if pos * lc + t % lc >= total:  # past the request's end: nothing may be written there
                for reg in mem.regions:
                    if mem.block_view(reg, b).any():
                        stray.append((t, b))
    return plans, errors, stray


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.sampled_from(ENGINES), p=st.sampled_from(ENGINES), num_tokens=st.integers(1, 37),
       hit=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_every_dcp_rank_gets_exactly_its_blocks(d, p, num_tokens, hit, seed):
    (lt, lc), (rt, rd) = d, p
    if lt % rt and rt % lt:
        return
    local, remote = mla_side(lt, lc), mla_side(rt, rd)
    total = -(-num_tokens // BLOCK)
    positions = -(-total // lc)
    computed = min(hit, positions)
    plans, errors, stray = run(local, remote, num_tokens, computed, np.random.default_rng(seed))
    assert not errors, errors
    assert not stray, stray
    assert plans[0].prefix_blocks_skipped == (computed,)
    for plan in plans:
        assert {r.remote_rank for r in plan.reads} <= set(plan.handshake_target_ranks)
        # Each request block this rank holds is read once, one latent block per layer.
        t = plan.local_rank
        held = sum(1 for pos in range(computed, positions) if pos * lc + t % lc < total)
        assert plan.nbytes == held * sum(reg.block_len for reg in local.pool.regions)


def test_hybrid_mla_ssm_with_equal_dcp():
    local, remote = mla_side(2, 2, ssm=True), mla_side(2, 2, ssm=True)
    l_ids, r_ids = [[5, 6, 7], [9]], [[1, 2, 3], [4]]
    remotes = {r: memory(remote) for r in range(2)}
    for r, mem in remotes.items():
        fill_rank(mem, r, 2, 1, r_ids, BLOCK, dcp_size=2)
    for t in range(2):
        mem = memory(local)
        apply_plan(plan_rank(local, remote, t, l_ids, r_ids, remote_num_tokens=11), mem, remotes)
        assert not check_rank(mem, t, 2, 1, l_ids, BLOCK, dcp_size=2, num_tokens=11)


# ---- refusals --------------------------------------------------------------------------


def test_dcp_needs_the_request_length():
    with pytest.raises(InvalidArgument) as e:
        prepare_blocks(mla_side(2, 1), mla_side(2, 2), [[1, 2, 3]], [[4, 5]])
    assert e.value.reason == "NUM_TOKENS_REQUIRED"


def test_dcp_block_counts_are_checked():
    with pytest.raises(InvalidArgument) as e:  # 9 tokens = 5 blocks need 3 per P rank at DCP 2
        prepare_blocks(mla_side(2, 1), mla_side(2, 2), [[1, 2, 3, 4, 5]], [[4, 5]], 9)
    assert e.value.reason == "BLOCK_COUNT_MISMATCH" and e.value.metadata["needed"] == "3"
    with pytest.raises(InvalidArgument) as e:  # 5 blocks fill 3 positions per D rank at DCP 2, not 4
        prepare_blocks(mla_side(2, 2), mla_side(2, 1), [[1, 2, 3, 4]], [[4, 5, 6, 7, 8]], 9)
    assert e.value.reason == "BLOCK_COUNT_MISMATCH"


@pytest.mark.parametrize(("kw", "field_text"), [
    ({"mla": False, "kv_heads": 2, "dcp_size": 2}, "DCP shards only MLA"),
    ({"mla": True, "kv_heads": 1, "dcp_size": 2, "tp_size": 4}, "must be 1 or the TP size 4"),
])
def test_invalid_dcp_layouts(kw, field_text):
    kw = {"tp_size": 2, **kw}
    with pytest.raises(InvalidArgument) as e:
        simple_layout(num_layers=1, head_size=4, block_size=BLOCK, **kw)
    assert e.value.reason == "INVALID_LAYOUT" and field_text in e.value.message


def test_incompatible_dcp_pairs():
    from kvsvc.mapping import validate_pair

    with pytest.raises(FailedPrecondition) as e:
        validate_pair(mla_side(2, 2, ssm=True), mla_side(2, 1, ssm=True))
    assert e.value.reason == "DCP_MISMATCH"
    with pytest.raises(FailedPrecondition) as e:
        validate_pair(mla_side(2, 2, block=4), mla_side(2, 2))
    assert e.value.reason == "BLOCK_SIZE_MISMATCH" and "DCP" in e.value.message


def test_num_tokens_trims_an_unfilled_tail_without_dcp():
    """A P list that ends in an allocated, unfilled block: the length says where the request ends,
    so a shorter D list is a prefix hit of the right size (not one block too many)."""
    side = Side.of(simple_layout(tp_size=1, kv_heads=2, num_layers=1, head_size=2, block_size=BLOCK, num_blocks=16,
                                 dtype="float32"), 1)
    r_ids, l_ids = [[4, 5, 6, 9]], [[1, 2]]  # 3 filled blocks + 1 unfilled; D holds the first already
    remote = memory(side)
    fill_rank(remote, 0, 1, 2, r_ids, BLOCK)
    plan = plan_rank(side, side, 0, l_ids, r_ids, remote_num_tokens=3 * BLOCK - 1)
    assert plan.prefix_blocks_skipped == (1,)
    mem = memory(side)
    apply_plan(plan, mem, {0: remote})
    assert not check_rank(mem, 0, 1, 2, l_ids, BLOCK, [1])
    with pytest.raises(InvalidArgument) as e:  # more tokens than the blocks hold
        plan_rank(side, side, 0, l_ids, r_ids, remote_num_tokens=5 * BLOCK)
    assert e.value.reason == "BLOCK_COUNT_MISMATCH"
