"""Layer 1 (pure): KV-cache spec types, engine layouts, regions and compatibility."""

from kvsvc.layout.build import layout_from_dict, simple_layout
from kvsvc.layout.compat import Violation, check_compatibility, compatibility_hash, tp_divisibility
from kvsvc.layout.engine import EngineLayout, KVCacheGroup, KvMemoryLayout, RegionLayout, per_rank_heads
from kvsvc.layout.kinds import KINDS, KindPolicy, policy_of, representative_spec_type, spec_family
from kvsvc.layout.regions import PoolLayout, Region, RegionKind, build_pool_layout
from kvsvc.layout.specs import (
    AttentionSpec,
    DType,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecFamily,
    UniformTypeKVCacheSpecs,
)

__all__ = [
    "KINDS", "AttentionSpec", "DType", "EngineLayout", "FullAttentionSpec", "KVCacheGroup", "KVCacheSpec", "KindPolicy",
    "KvMemoryLayout", "MLAAttentionSpec", "MambaSpec", "PoolLayout", "Region", "RegionKind", "RegionLayout",
    "SlidingWindowSpec", "SpecFamily", "UniformTypeKVCacheSpecs", "Violation", "build_pool_layout",
    "check_compatibility", "compatibility_hash", "layout_from_dict", "per_rank_heads", "policy_of",
    "representative_spec_type", "simple_layout", "spec_family", "tp_divisibility",
]
