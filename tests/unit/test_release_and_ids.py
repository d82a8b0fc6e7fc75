"""Descriptor ids (MAPPING.md §5) and release accounting (§7)."""

from __future__ import annotations

import pytest

from kvsvc.mapping import ReleaseTracker, descriptor_ids, expected_notifiers, handshake_target_ranks


def test_descriptor_id_example():
    ids = descriptor_ids([[1, 2], [3]], num_regions=4, num_blocks=100)
    assert ids.tolist() == [1, 2, 3, 101, 102, 103, 201, 202, 203, 301, 302, 303]


def test_descriptor_ids_with_ssm():
    ids = descriptor_ids([[1, 2], [5]], num_regions=2, num_blocks=10, ssm_groups=[1], num_ssm_regions=2,
                         ssm_logical_blocks=10)
    assert ids.tolist() == [1, 2, 11, 12, 20 + 5, 20 + 15]


@pytest.mark.parametrize(("lt", "rt"), [(1, 1), (2, 1), (8, 2), (1, 4), (2, 8), (16, 8)])
def test_notifiers_are_exactly_the_ranks_targeting_each_p_rank(lt, rt):
    for p in range(rt):
        want = {t for t in range(lt) if p in handshake_target_ranks(t, lt, rt)}
        assert expected_notifiers(p, lt, rt) == want
        assert len(want) == (lt // rt if lt > rt else 1)


def test_tracker_releases_when_all_d_ranks_notified():
    tr = ReleaseTracker([0, 1], d_tp_size=4, p_tp_size=2)
    assert tr.notify([0]) == []
    assert tr.notify([1]) == [0]
    assert not tr.done
    assert tr.notify([1]) == []  # duplicate is harmless
    assert tr.notify([2, 3]) == [1]
    assert tr.done and tr.pending_d_ranks == []


def test_tracker_p_gt_d_covers_skipped_ranks():
    # K=2, P TP 4 -> D TP 2: GQA dedup reads P ranks 0 and 2 only, but 1 and 3 must still release.
    tr = ReleaseTracker(range(4), d_tp_size=2, p_tp_size=4)
    assert sorted(tr.notify([0])) == [0, 1]
    assert sorted(tr.notify([1])) == [2, 3]
    assert tr.done
