"""KV-cache spec types (as vLLM's hybrid allocator knows them), their page arithmetic, and
the names of their memory orders and transfer families (kinds.py says what each kind does)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvsvc.errors import InvalidArgument
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
    """Mamba (SSM) state: per-rank shapes (first dim sharded across TP) and dtypes.

    page_bytes: 0 for states each packed in a region of their own; else a block's states
    lie back to back at the start of a page of this many bytes (an engine's padded page)."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[DType, ...] = ()
    page_bytes: int = 0

    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor of one block on one rank."""
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))

    def page_size_bytes(self) -> int:
        return self.page_bytes or sum(self.state_bytes())


@dataclass(frozen=True, slots=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one spec family with possibly different page sizes, in layer order."""

    kv_cache_specs: tuple[tuple[str, KVCacheSpec], ...] = ()

    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes() for _, spec in self.kv_cache_specs)

    def layer_specs(self) -> Iterator[tuple[str, KVCacheSpec]]:
        return iter(self.kv_cache_specs)


class KvMemoryLayout(enum.Enum):
    """Dimension order inside one attention block."""

    HND = "HND"  # [heads, tokens, head_size]: heads contiguous
    NHD = "NHD"  # [tokens, heads, head_size]


class RegionLayout(enum.Enum):
    """How K and V of one attention layer are placed."""

    SPLIT_KV = "split_kv"  # two regions per layer: K blocks, then V blocks
    BLOCKS_FIRST = "blocks_first"  # one [num_blocks, 2, ...] allocation per layer
    PACKED_KV = "packed_kv"  # one region per layer; K and V of a token packed inside each head


def per_rank_heads(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: K // tp, or 1 when heads are replicated (tp > K)."""
    return max(1, total_num_kv_heads // tp_size)


class SpecFamily(enum.Enum):
    """Transfer family of a spec: how its bytes split across TP ranks."""

    ATTENTION = "attention"  # heads split across ranks
    MLA = "mla"  # identical latent cache on every rank
    SSM = "ssm"  # state sharded across ranks
