"""What an engine worker tells kvsvc of its KV cache, typed: the contract between an engine
integration and kvsvc's layout model.

An integration reads its engine's own description (vLLM's KVCacheConfig and tensors,
SGLang's KVArgs) and builds this rank's EngineLayout directly: the specs kvsvc compares
with its peers, never a TOML-shaped table parsed back. The buffers are the engine's memory,
registered in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsvc.layout.engine import EngineLayout, KVCacheGroup
from kvsvc.layout.specs import KVCacheSpec


@dataclass(frozen=True)
class CacheDescription:
    """layout: this rank's (per-rank head counts); buffers: one per region, in the layout's
    region order; blocks_per_logical: how many kvsvc blocks make one of the engine's blocks
    (an attention backend whose kernel block is smaller than the engine's block)."""

    layout: EngineLayout
    buffers: Sequence[Any]
    blocks_per_logical: int = 1


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one spec sharing one block table, as an engine counts them."""

    name: str
    spec: KVCacheSpec
    num_layers: int
    num_blocks: int = 0  # the group's own pool size; 0: the layout's


def numbered_groups(groups: Sequence[LayerGroup]) -> tuple[KVCacheGroup, ...]:
    """The groups with their layers named layers.0, layers.1, ... in order over all groups:
    the names a [layout] table's layers get, so an engine's layout and a table's compare
    layer by layer."""
    out, first = [], 0
    for g in groups:
        out.append(KVCacheGroup(g.name, g.spec, tuple(f"layers.{first + i}" for i in range(g.num_layers)),
                                g.num_blocks))
        first += g.num_layers
    return tuple(out)
