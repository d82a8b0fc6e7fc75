"""vLLM's KV caches as a kvsvc layout, and the per-region views kvsvc registers in place.

Read from vLLM's KVCacheConfig (groups, layer names, specs) and the tensors it
allocated, never from a copy. Supported: vLLM's CPU attention layout (a layer is
[num_blocks, heads, block_size, head_size + head_size_v], K and V packed per token:
kvsvc's packed_kv), MLA ([num_blocks, block_size, head_size]: latent; on CPU with a head
axis of one), and the split K/V layout of GPU backends ([2, num_blocks, block_size,
heads, head_size] with the stride order deciding HND or NHD). Anything else is refused
with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import FailedPrecondition

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32",
           "torch.float8_e4m3fn": "float8_e4m3", "torch.float8_e5m2": "float8_e5m2", "torch.uint8": "uint8"}


@dataclass
class CacheDescription:
    """The layout table (for kvsvc's config) and one buffer per region, in region order."""

    table: dict[str, Any]
    buffers: list[Any]


def _refuse(message: str, **meta: object) -> FailedPrecondition:
    return FailedPrecondition("UNSUPPORTED_KV_LAYOUT", message, {k: str(v) for k, v in meta.items()})


def _dtype(t: Any) -> str:
    name = str(t.dtype)
    if name not in _DTYPES:
        raise _refuse(f"KV dtype {name} is not supported", dtype=name)
    return _DTYPES[name]


def _attention_views(name: str, t: Any, spec: Any) -> tuple[list[Any], str, str]:
    """(region views, region_layout, kv_memory_layout) of one attention layer's tensor."""
    heads, block, hs = spec.num_kv_heads, spec.block_size, spec.head_size
    hv = getattr(spec, "head_size_v", None) or hs
    if t.dim() == 4 and tuple(t.shape[1:]) in ((heads, block, hs + hv), (block, heads, hs + hv)):
        # CPU attention: one tensor per layer, K and V packed per token inside each head.
        hnd = tuple(t.shape[1:3]) == (heads, block) and (heads == block or t.stride(1) >= t.stride(2))
        return [t], "packed_kv", "HND" if hnd else "NHD"
    if t.dim() == 5 and t.shape[0] == 2 and hs == hv and tuple(t.shape[2:]) == (block, heads, hs):
        # GPU backends: [2, blocks, block_size, heads, head_size], the physical order in the strides.
        hnd = heads > 1 and t.stride(3) > t.stride(2)
        return [t[0], t[1]], "split_kv", "HND" if hnd else "NHD"
    raise _refuse(f"layer {name}: KV tensor of shape {tuple(t.shape)} is not a layout kvsvc knows "
                  f"(heads {heads}, block {block}, head sizes {hs}/{hv})", layer=name, shape=tuple(t.shape))


def _latent_view(name: str, t: Any, spec: Any) -> Any:
    """An MLA layer as [num_blocks, block_size, head_size]: GPU backends allocate it so, the CPU
    backend with a head axis of one ([num_blocks, 1, block_size, head_size])."""
    latent = (spec.block_size, spec.head_size)
    if t.dim() == 3 and tuple(t.shape[1:]) == latent:
        return t
    if t.dim() == 4 and tuple(t.shape[1:]) in ((1, *latent), (latent[0], 1, latent[1])):
        return t.flatten(1, 2)  # a view: the axis of one adds no stride
    raise _refuse(f"MLA layer {name}: tensor of shape {tuple(t.shape)} (block {latent[0]}, latent {latent[1]})",
                  layer=name, shape=tuple(t.shape))


def describe(kv_caches: Mapping[str, Any], kv_cache_config: Any, *, model_id: str, total_num_kv_heads: int,
             dcp_size: int = 1) -> CacheDescription:
    """The kvsvc layout of one worker's caches and the views to register, in kvsvc's region order."""
    groups: list[dict[str, Any]] = []
    buffers: list[Any] = []
    memory = region = None
    block = num_blocks = dtype = None
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, names = group.kv_cache_spec, list(group.layer_names)
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec"):
            raise _refuse(f"KV cache group {gi} is {kind}; kvsvc's vLLM connector moves full, sliding-window "
                          "and MLA attention", group=gi, spec=kind)
        entry: dict[str, Any] = {"name": f"g{gi}", "num_layers": len(names), "head_size": spec.head_size}
        for name in names:
            if name not in kv_caches:
                raise _refuse(f"layer {name} of group {gi} has no KV tensor", layer=name)
            t = kv_caches[name]
            if kind == "MLAAttentionSpec":
                views, nb = [_latent_view(name, t, spec)], int(t.shape[0])
            else:
                views, reg, mem = _attention_views(name, t, spec)
                if (region or reg, memory or mem) != (reg, mem):
                    raise _refuse("layers use different KV layouts", layer=name)
                region, memory = reg, mem
                nb = int(views[0].shape[0])
            if (num_blocks or nb, dtype or _dtype(t), block or spec.block_size) != (nb, _dtype(t), spec.block_size):
                raise _refuse("layers differ in block count, dtype or block size", layer=name)
            num_blocks, dtype, block = nb, _dtype(t), spec.block_size
            buffers.extend(views)
        if kind == "MLAAttentionSpec":
            entry["kind"] = "mla"
        elif kind == "SlidingWindowSpec":
            entry.update(kind="sliding_window", sliding_window=spec.sliding_window)
        else:
            entry.update(kind="full_attention", head_size_v=getattr(spec, "head_size_v", 0) or 0)
        groups.append(entry)
    if not groups:
        raise _refuse("the engine has no KV cache groups")
    table = {"model_id": model_id, "total_num_kv_heads": total_num_kv_heads, "block_size": block,
             "num_blocks": num_blocks, "dtype": dtype, "groups": groups, "dcp_size": dcp_size,
             "kv_memory_layout": memory or "HND", "region_layout": region or "split_kv"}
    return CacheDescription(table, buffers)
