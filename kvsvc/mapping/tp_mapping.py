"""compute_tp_mapping: which remote ranks a local rank reads, per group (MAPPING.md §3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsvc.layout.kinds import spec_family_of_type
from kvsvc.layout.specs import KVCacheSpec, SpecFamily
from kvsvc.mapping.dcp import dcp_source_ranks
from kvsvc.mapping.topology import tp_ratio


class TopologyLike(Protocol):
    """Anything with the four attributes the mapping needs (TransferTopology, or an engine's)."""

    @property
    def tp_rank(self) -> int: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def total_num_kv_heads(self) -> int: ...

    @property
    def is_mla(self) -> bool: ...

    @property
    def dcp_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TPMapping:
    """Remote source ranks of one local rank.

    source_ranks_per_group: per group, the remote ranks read (SSM groups may read more).
    all_source_ranks: the sorted union.
    rank_to_attention_slot: remote rank -> position of its heads in the local block.
    rank_offset_factor: which local-sized chunk of a remote block this rank reads (L > R).
    """

    source_ranks_per_group: tuple[tuple[int, ...], ...]
    all_source_ranks: tuple[int, ...]
    rank_to_attention_slot: dict[int, int]
    rank_offset_factor: int


def _attention_sources(t: int, lt: int, rt: int, k: int, is_mla: bool) -> list[int]:
    if is_mla or lt >= rt:
        # MLA with R = k·L spreads D rank t onto P rank k·t instead of every rank on 0.
        return [t * rt // lt]
    a = rt // lt
    start = t * a
    kept: list[int] = []
    heads_seen: set[int] = set()
    for j in range(a):
        head = (start + j) * k // rt
        if head not in heads_seen:  # GQA dedup: with K < R several P ranks hold one head
            heads_seen.add(head)
            kept.append(start + j)
    return kept


def compute_tp_mapping(
    topology: TopologyLike, remote_tp_size: int, group_spec_types: Sequence[type[KVCacheSpec]],
    remote_dcp_size: int = 1,
) -> TPMapping:
    """The source ranks, slots and offset factor of topology's rank against remote_tp_size.

    A remote MLA engine with DCP holds each block on one rank: the sources are the ranks
    holding this rank's blocks (§9), each filling the block positions it holds.
    """
    t, lt, rt = topology.tp_rank, topology.tp_size, remote_tp_size
    k, is_mla = topology.total_num_kv_heads, topology.is_mla
    tp_ratio(lt, rt)  # raises TP_NOT_DIVISIBLE
    if is_mla and remote_dcp_size > 1:
        attn = dcp_source_ranks(t, topology.dcp_size, rt, remote_dcp_size)
    else:
        attn = _attention_sources(t, lt, rt, k, is_mla)
    has_ssm = any(spec_family_of_type(s) is SpecFamily.SSM for s in group_spec_types)
    if not has_ssm:
        ssm: list[int] = []
    elif lt < rt:
        a = rt // lt
        ssm = list(range(t * a, t * a + a))  # SSM state is always sharded
    else:
        ssm = list(attn)
    per_group = tuple(tuple(ssm) if spec_family_of_type(s) is SpecFamily.SSM else tuple(attn) for s in group_spec_types)
    all_src = tuple(sorted(set(attn) | set(ssm)))
    head_slot = {r * k // rt: i for i, r in enumerate(attn)}
    slots = {r: head_slot.get(r * k // rt, 0) for r in all_src}
    if is_mla or lt <= rt:
        offset = 0
    elif lt > k:
        offset = (t * k // lt) - (attn[0] * k // rt)
    else:
        offset = t % (lt // rt)
    return TPMapping(per_group, all_src, slots, offset)

