"""KV-cache spec types (as vLLM's hybrid allocator knows them) and their page arithmetic."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.reasons import Reason


class DType(enum.Enum):
    """Element type of a cache tensor; the value is its size in bytes and name."""

    FLOAT16 = ("float16", 2)
    BFLOAT16 = ("bfloat16", 2)
    FLOAT32 = ("float32", 4)
    FLOAT8_E4M3 = ("float8_e4m3", 1)
    FLOAT8_E5M2 = ("float8_e5m2", 1)
    UINT8 = ("uint8", 1)

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def type_name(self) -> str:
        return self.value[0]

    @classmethod
    def parse(cls, name: str) -> DType:
        for d in cls:
            if name.lower() in (d.type_name, d.name.lower()):
                return d
        raise InvalidArgument(
            Reason.UNKNOWN_DTYPE,
            f"unknown dtype {name!r}; use one of {[d.type_name for d in cls]}",
            {"dtype": name},
        )


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base spec: what one layer stores per block. block_size is in tokens."""

    block_size: int

    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer on one rank."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    """Attention with K and V; num_kv_heads is per TP rank."""

    num_kv_heads: int
    head_size: int
    dtype: DType

    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention; head_size_v differs from head_size in some models (0: equal)."""

    head_size_v: int = 0

    @property
    def value_head_size(self) -> int:
        return self.head_size_v or self.head_size

    def page_size_bytes(self) -> int:
        per_token = self.num_kv_heads * (self.head_size + self.value_head_size)
        return self.block_size * per_token * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token, identical on every rank."""

    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention; sliding_window is in tokens."""

    sliding_window: int = 0


@dataclass(frozen=True, slots=True)
class MambaSpec(KVCacheSpec):
    """Mamba (SSM) state: per-rank shapes (first dim sharded across TP) and dtypes."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[DType, ...] = ()

    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor of one block on one rank."""
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))

    def page_size_bytes(self) -> int:
        return sum(self.state_bytes())


@dataclass(frozen=True, slots=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one spec family with possibly different page sizes, in layer order."""

    kv_cache_specs: tuple[tuple[str, KVCacheSpec], ...] = ()

    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes() for _, spec in self.kv_cache_specs)

    def layer_specs(self) -> Iterator[tuple[str, KVCacheSpec]]:
        return iter(self.kv_cache_specs)


class SpecFamily(enum.Enum):
    """Transfer family of a spec: how its bytes split across TP ranks."""

    ATTENTION = "attention"  # heads split across ranks
    MLA = "mla"  # identical latent cache on every rank
    SSM = "ssm"  # state sharded across ranks


def representative_spec_type(spec: KVCacheSpec) -> type[KVCacheSpec]:
    """The class that stands for a group: a uniform wrapper's first inner spec's class."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        if not spec.kv_cache_specs:
            raise InvalidArgument(Reason.EMPTY_GROUP, "a uniform-type spec needs at least one layer")
        return type(spec.kv_cache_specs[0][1])
    return type(spec)


def spec_family_of_type(spec_type: type[KVCacheSpec]) -> SpecFamily:
    """Family of a (leaf) spec class."""
    if issubclass(spec_type, MLAAttentionSpec):
        return SpecFamily.MLA
    if issubclass(spec_type, AttentionSpec):
        return SpecFamily.ATTENTION
    if issubclass(spec_type, MambaSpec):
        return SpecFamily.SSM
    raise InvalidArgument(Reason.UNKNOWN_SPEC_TYPE, f"spec type {spec_type.__name__} has no transfer family")


def spec_family(spec: KVCacheSpec) -> SpecFamily:
    """Family of a group spec, looking at every inner spec of a uniform wrapper.

    The representative type alone is not enough: a wrapper whose first layer is MLA but
    whose later layers are not would be transferred with the wrong geometry, so mixed
    wrappers are rejected here.
    """
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return spec_family_of_type(type(spec))
    families = {name: spec_family_of_type(type(inner)) for name, inner in spec.layer_specs()}
    distinct = sorted({f.value for f in families.values()})
    if len(distinct) > 1:
        # A well-formed request for an unsupported combination: FAILED_PRECONDITION.
        raise FailedPrecondition(
            Reason.MIXED_FAMILY_GROUP,
            "a uniform-type group mixes spec families "
            + ", ".join(f"{n}={f.value}" for n, f in families.items())
            + "; split it into one group per family",
            {"families": ",".join(distinct)},
        )
    for name, inner in spec.layer_specs():
        if isinstance(inner, UniformTypeKVCacheSpecs):
            raise InvalidArgument(Reason.NESTED_UNIFORM_GROUP, f"layer {name} nests a uniform-type spec")
    return spec_family_of_type(representative_spec_type(spec))

