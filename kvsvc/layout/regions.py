"""Regions of one rank's pool: where each layer's K, V, latent or state blocks live."""

from __future__ import annotations

from dataclasses import dataclass

from kvsvc.layout.engine import EngineLayout
from kvsvc.layout.kinds import RegionKind as RegionKind  # re-exported: a Region's kind
from kvsvc.layout.kinds import policy_of
from kvsvc.layout.specs import DType

# Allocations start on this boundary so that every region is page-friendly for DMA.
REGION_ALIGN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Region:
    """One region of one rank. Offsets and lengths are bytes.

    An attention block is [heads, tokens, head_bytes] (HND) or [tokens, heads,
    head_bytes] (NHD). A latent block is [tokens, head_bytes] with heads == 1. An SSM
    block is state_bytes opaque bytes, sharded contiguously across TP.
    """

    index: int
    kind: RegionKind
    group_index: int
    layer_name: str
    pool_offset: int
    block_len: int
    block_stride: int
    num_blocks: int
    heads: int = 0
    tokens: int = 0
    head_bytes: int = 0
    head_major: bool = True
    elements: tuple[int, ...] = ()  # a block as typed elements: what an engine views it as
    dtype: DType | None = None

    @property
    def is_ssm(self) -> bool:
        return self.kind is RegionKind.SSM_STATE

    @property
    def extent(self) -> int:
        """Bytes from block 0 to the end of the last block."""
        return (self.num_blocks - 1) * self.block_stride + self.block_len


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """All regions of one rank and the pool size that holds them."""

    regions: tuple[Region, ...]
    size_bytes: int


def _align(n: int) -> int:
    return -(-n // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES


def build_pool_layout(layout: EngineLayout) -> PoolLayout:
    """Place every region of one rank, region-major over groups and layers."""
    regions: list[Region] = []
    cursor = 0

    for gi, group in enumerate(layout.groups):
        nb = layout.group_blocks(gi)
        for name, spec in group.layers():
            for alloc in policy_of(spec).allocations(spec, layout.memory_order, layout.region_layout):
                for part in alloc.parts:
                    regions.append(Region(len(regions), part.kind, gi, name, cursor + part.offset, part.length,
                                          alloc.stride, nb, part.heads, part.tokens, part.head_bytes,
                                          part.head_major, part.elements, part.dtype))
                cursor = _align(cursor + nb * alloc.stride)
    return PoolLayout(tuple(regions), max(cursor, REGION_ALIGN_BYTES))
