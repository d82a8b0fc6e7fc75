"""Regions of one rank's pool: where each layer's K, V, latent or state blocks live."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvsvc.layout.engine import EngineLayout, KvMemoryLayout, RegionLayout
from kvsvc.layout.specs import AttentionSpec, FullAttentionSpec, MambaSpec, MLAAttentionSpec

# Allocations start on this boundary so that every region is page-friendly for DMA.
REGION_ALIGN_BYTES = 4096


class RegionKind(enum.Enum):
    KEY = "key"
    VALUE = "value"
    KV = "kv"  # K and V of a token packed inside each head (packed_kv)
    LATENT = "latent"
    SSM_STATE = "ssm_state"


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
    nb = layout.num_blocks
    hnd = layout.memory_order is KvMemoryLayout.HND

    def add(kind: RegionKind, gi: int, name: str, off: int, length: int, stride: int, **geo: int | bool) -> None:
        regions.append(Region(len(regions), kind, gi, name, off, length, stride, nb, **geo))  # type: ignore[arg-type]

    for gi, group in enumerate(layout.groups):
        for name, spec in group.layers():
            if isinstance(spec, MLAAttentionSpec):
                length = spec.page_size_bytes()
                add(RegionKind.LATENT, gi, name, cursor, length, length,
                    heads=1, tokens=spec.block_size, head_bytes=spec.head_size * spec.dtype.itemsize)
                cursor = _align(cursor + nb * length)
            elif isinstance(spec, AttentionSpec):
                e = spec.dtype.itemsize
                hv = spec.value_head_size if isinstance(spec, FullAttentionSpec) else spec.head_size
                k_len = spec.block_size * spec.num_kv_heads * spec.head_size * e
                v_len = spec.block_size * spec.num_kv_heads * hv * e
                geo_k = dict(heads=spec.num_kv_heads, tokens=spec.block_size, head_bytes=spec.head_size * e,
                             head_major=hnd)
                geo_v = dict(geo_k, head_bytes=hv * e)
                if layout.region_layout is RegionLayout.PACKED_KV:
                    # A head's row is K then V of one token: heads stay outermost (HND), so a
                    # head slice of a block is still one contiguous run.
                    add(RegionKind.KV, gi, name, cursor, k_len + v_len, k_len + v_len,
                        **dict(geo_k, head_bytes=(spec.head_size + hv) * e))
                    cursor = _align(cursor + nb * (k_len + v_len))
                elif layout.region_layout is RegionLayout.BLOCKS_FIRST:
                    stride = k_len + v_len
                    add(RegionKind.KEY, gi, name, cursor, k_len, stride, **geo_k)
                    add(RegionKind.VALUE, gi, name, cursor + k_len, v_len, stride, **geo_v)
                    cursor = _align(cursor + nb * stride)
                else:
                    add(RegionKind.KEY, gi, name, cursor, k_len, k_len, **geo_k)
                    cursor = _align(cursor + nb * k_len)
                    add(RegionKind.VALUE, gi, name, cursor, v_len, v_len, **geo_v)
                    cursor = _align(cursor + nb * v_len)
            elif isinstance(spec, MambaSpec):
                for length in spec.state_bytes():
                    add(RegionKind.SSM_STATE, gi, name, cursor, length, length)
                    cursor = _align(cursor + nb * length)
    return PoolLayout(tuple(regions), max(cursor, REGION_ALIGN_BYTES))
