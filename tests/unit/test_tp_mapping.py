"""compute_tp_mapping and TransferTopology against MAPPING.md §9 and §2."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsvc.errors import FailedPrecondition
from kvsvc.layout.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec
from kvsvc.mapping import TransferTopology, compute_tp_mapping

FA, SSM, MLA = FullAttentionSpec, MambaSpec, MLAAttentionSpec

# L, t, R, K, mla, groups, source_ranks_per_group, all, slots, offset  (MAPPING.md §9)
ROWS = [
    (2, 1, 2, 8, False, (FA,), ((1,),), (1,), {1: 0}, 0),
    (4, 2, 2, 8, False, (FA,), ((1,),), (1,), {1: 0}, 0),
    (1, 0, 2, 8, False, (FA,), ((0, 1),), (0, 1), {0: 0, 1: 1}, 0),
    (2, 1, 8, 8, False, (FA,), ((4, 5, 6, 7),), (4, 5, 6, 7), {4: 0, 5: 1, 6: 2, 7: 3}, 0),
    (1, 0, 8, 2, False, (FA, SSM), ((0, 4), tuple(range(8))), tuple(range(8)),
     {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}, 0),
    (2, 0, 4, 8, False, (SSM, FA), ((0, 1), (0, 1)), (0, 1), {0: 0, 1: 1}, 0),
    (2, 1, 8, 8, True, (MLA,), ((4,),), (4,), {4: 0}, 0),
    (1, 0, 4, 8, True, (MLA,), ((0,),), (0,), {0: 0}, 0),
]


@pytest.mark.parametrize(("lt", "t", "rt", "k", "mla", "groups", "per_group", "all_src", "slots", "offset"), ROWS)
def test_worked_examples(lt, t, rt, k, mla, groups, per_group, all_src, slots, offset):
    m = compute_tp_mapping(TransferTopology(t, lt, k, mla), rt, groups)
    assert m.source_ranks_per_group == per_group
    assert m.all_source_ranks == all_src
    assert m.rank_to_attention_slot == slots
    assert m.rank_offset_factor == offset


def test_mla_ranks_spread_over_remote_ranks():
    # The DeepSeek-V4 regression: every MLA D rank read P rank 0.
    sources = [compute_tp_mapping(TransferTopology(t, 2, 1, True), 8, (MLA,)).all_source_ranks for t in range(2)]
    assert sources == [(0,), (4,)]


def test_accepts_any_topology_like_object():
    topo = SimpleNamespace(tp_rank=1, tp_size=4, total_num_kv_heads=8, is_mla=False)
    assert compute_tp_mapping(topo, 2, (FA,)).all_source_ranks == (0,)
    assert compute_tp_mapping(topo, 2, (FA,)).rank_offset_factor == 1


def test_replicated_local_heads_offset():
    # L > K: D ranks 0,1 share head 0 and ranks 2,3 head 1, both inside P rank 0's two heads.
    offs = [compute_tp_mapping(TransferTopology(t, 4, 2, False), 1, (FA,)).rank_offset_factor for t in range(4)]
    assert offs == [0, 0, 1, 1]


@pytest.mark.parametrize(("lt", "rt", "ratio"), [(4, 2, 2), (2, 2, 1), (2, 8, -4), (1, 4, -4)])
def test_tp_ratio(lt, rt, ratio):
    assert TransferTopology(0, lt, 8).tp_ratio(rt) == ratio


def test_handshake_targets():
    assert TransferTopology(3, 4, 8).handshake_target_ranks(2) == [1]
    assert TransferTopology(1, 2, 8).handshake_target_ranks(8) == [4, 5, 6, 7]


@pytest.mark.parametrize(("lt", "rt"), [(3, 2), (2, 3), (4, 6)])
def test_non_divisible_tp(lt, rt):
    with pytest.raises(FailedPrecondition) as e:
        compute_tp_mapping(TransferTopology(0, lt, 8), rt, (FA,))
    assert e.value.reason == "TP_NOT_DIVISIBLE"
    assert e.value.metadata == {"local_tp_size": str(lt), "remote_tp_size": str(rt)}


def test_describe_is_one_line():
    line = TransferTopology(1, 2, 8, block_size=16).describe(8, remote_block_len=4096)
    assert "\n" not in line
    for part in ("tp_ratio=-4", "num_kv_heads=4", "local_tp=2", "remote_tp=8", "rank=1", "remote_block_len=4096"):
        assert part in line
    assert "num_kv_heads=1" in TransferTopology(0, 2, 8, is_mla=True).describe(2)
