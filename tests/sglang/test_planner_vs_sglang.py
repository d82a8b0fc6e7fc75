"""kvsvc's TP mapping against SGLang's, over a sweep of TP pairs and KV head counts.

SGLang (pushing, P -> D) picks the prefill ranks a decode rank gets KV from in
CommonKVManager._resolve_rank_mapping, and the head slice each such pair moves in
compute_head_slice_params (common/staging_buffer.py). kvsvc (pulling, D reads P) has
compute_tp_mapping and the head runs of its planner. For every decode rank both must give
that rank exactly its own KV heads, each from a prefill rank that holds it. Where they
differ (asserted, so a change on either side shows): with more prefill ranks than KV heads
and more prefill than decode ranks, SGLang writes a decode head once per prefill replica
of it (identical bytes, several times), kvsvc reads it once. For MLA both read a decode
rank's latent from the same one prefill rank (D rank d from P rank d·P/D when P > D).
"""

from __future__ import annotations

import itertools

import pytest
from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

from kvsvc.layout.specs import FullAttentionSpec, MLAAttentionSpec
from kvsvc.mapping.geometry import _head_runs
from kvsvc.mapping.topology import tp_ratio
from kvsvc.mapping.tp_mapping import compute_tp_mapping

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)


class Rank:
    def __init__(self, tp_rank: int, tp_size: int, heads: int, mla: bool = False) -> None:
        self.tp_rank, self.tp_size, self.total_num_kv_heads, self.is_mla, self.dcp_size = tp_rank, tp_size, heads, mla, 1


def sweep(mla: bool = False):
    for p_tp, d_tp, k in itertools.product(TPS, TPS, (1,) if mla else HEADS):
        if max(p_tp, d_tp) % min(p_tp, d_tp) == 0:
            yield p_tp, d_tp, k


def global_head(rank: int, tp: int, k: int, local: int) -> int:
    """The model's KV head held at local head `local` of `rank` (replicated when tp > k)."""
    return rank * k // tp if tp >= k else rank * (k // tp) + local


def sglang_targets(d: int, d_tp: int, p_tp: int, mla: bool) -> list[int]:
    """SGLang's _resolve_rank_mapping for one decode rank (no DCP, no KV sharding, no CP)."""
    if d_tp == p_tp:
        return [d]
    if d_tp > p_tp:
        return [d // (d_tp // p_tp)]
    ranks = list(range(d * (p_tp // d_tp), (d + 1) * (p_tp // d_tp)))
    return ranks[:1] if mla else ranks


def sglang_writes(d: int, d_tp: int, p_tp: int, k: int) -> dict[int, list[tuple[int, int]]]:
    """decode local head -> [(prefill rank, prefill local head)] for every write SGLang makes."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in sglang_targets(d, d_tp, p_tp, mla=False):
        src0, n, dst0, _ = compute_head_slice_params(p_tp, d_tp, s, d, k)
        for i in range(n):
            out.setdefault(dst0 + i, []).append((s, src0 + i))
    return out


def kvsvc_reads(d: int, d_tp: int, p_tp: int, k: int) -> dict[int, list[tuple[int, int]]]:
    """decode local head -> [(prefill rank, prefill local head)] for every read kvsvc plans."""
    mapping = compute_tp_mapping(Rank(d, d_tp, k), p_tp, [FullAttentionSpec])
    runs = _head_runs(max(1, k // d_tp), mapping, mapping.source_ranks_per_group[0], max(1, k // p_tp),
                      tp_ratio(d_tp, p_tp), latent=False)
    out: dict[int, list[tuple[int, int]]] = {}
    for h0, count, rank, r0 in runs:
        for i in range(count):
            out.setdefault(h0 + i, []).append((rank, r0 + i))
    return out


@pytest.mark.parametrize(("p_tp", "d_tp", "k"), list(sweep()))
def test_both_give_every_decode_rank_its_own_heads(p_tp, d_tp, k):
    for d in range(d_tp):
        want = {h: global_head(d, d_tp, k, h) for h in range(max(1, k // d_tp))}
        for name, got in (("sglang", sglang_writes(d, d_tp, p_tp, k)), ("kvsvc", kvsvc_reads(d, d_tp, p_tp, k))):
            assert set(got) == set(want), (name, d, got)
            for h, sources in got.items():
                assert {global_head(r, p_tp, k, rh) for r, rh in sources} == {want[h]}, (name, d, h, sources)
        theirs, ours = sglang_writes(d, d_tp, p_tp, k), kvsvc_reads(d, d_tp, p_tp, k)
        assert all(len(s) == 1 for s in ours.values())  # kvsvc reads each decode head once
        replicas = p_tp // k // max(1, d_tp // k) if p_tp > k and p_tp > d_tp else 1
        assert {len(s) for s in theirs.values()} == {max(1, replicas)}, (d, theirs)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(p, d) for p, d, _ in sweep(mla=True)])
def test_mla_reads_the_same_prefill_rank(p_tp, d_tp):
    for d in range(d_tp):
        mapping = compute_tp_mapping(Rank(d, d_tp, 1, mla=True), p_tp, [MLAAttentionSpec])
        assert list(mapping.source_ranks_per_group[0]) == sglang_targets(d, d_tp, p_tp, mla=True)
