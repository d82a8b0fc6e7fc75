"""Layer 2 (pure, numpy only): TP mapping, descriptor geometry, descriptor ids, release accounting."""

from kvsvc.mapping.descriptor_ids import descriptor_ids
from kvsvc.mapping.geometry import Reads, coalesce
from kvsvc.mapping.planner import RankPlan, RequestBlocks, Side, plan_rank, prepare_blocks, trim_prefix, validate_pair
from kvsvc.mapping.release import ReleaseTracker, expected_notifiers
from kvsvc.mapping.topology import TransferTopology, handshake_target_ranks, tp_ratio
from kvsvc.mapping.tp_mapping import TopologyLike, TPMapping, compute_tp_mapping

__all__ = [
    "RankPlan",
    "Reads",
    "ReleaseTracker",
    "RequestBlocks",
    "Side",
    "TPMapping",
    "TopologyLike",
    "TransferTopology",
    "coalesce",
    "compute_tp_mapping",
    "descriptor_ids",
    "expected_notifiers",
    "handshake_target_ranks",
    "plan_rank",
    "prepare_blocks",
    "tp_ratio",
    "trim_prefix",
    "validate_pair",
]
