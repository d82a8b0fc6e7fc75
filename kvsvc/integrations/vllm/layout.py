"""vLLM's KV caches as a kvsvc layout, and the per-region views kvsvc registers in place.

Read from vLLM's KVCacheConfig (groups, layer names, specs) and the tensors it
allocated, never from a copy. vLLM 0.32 hands every backend, CPU and GPU alike, a layer as
the logical view [blocks, heads, tokens, head_size + head_size_v] (K and V packed per token
inside each head: kvsvc's packed_kv) whose strides carry the resolved KV cache layout:
LBHNC (heads outside tokens: HND, what the connector asks for, since a TP pair that
splits heads then reads a head's rows of a block as one run) or LBNHC (NHD: such a pair
reads a token row at a time, more descriptors for the same bytes). MLA is the
latent [blocks, tokens, head_size] (or with a head axis of one). Also read: the split K/V
tensors [2, blocks, tokens, heads, head_size] some backends allocate.

A hybrid model's Mamba layer comes as the raw bytes of its state pages, [blocks, ..., state
bytes], a page apart (vLLM pads the state page to the attention page): a region per state,
each stepping by the page (MambaSpec.page_size_bytes).

A backend's kernel block may be smaller than vLLM's block (vLLM then splits each block
into blocks_per_logical kernel blocks, dim 0 counting kernel blocks): kvsvc's layout then
uses the kernel block, and the connector turns vLLM's block ids into kernel block ids
(kernel_block_ids). Layouts that interleave layers inside a block (BLHNC, BLNHC, BHLNC)
or pad pages are refused with what to set instead.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import FailedPrecondition
from kvsvc.integrations.description import CacheDescription, LayerGroup, numbered_groups
from kvsvc.layout.engine import EngineLayout, KvMemoryLayout, RegionLayout
from kvsvc.layout.specs import DType, FullAttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from kvsvc.reasons import Reason

_DTYPES = {"torch.bfloat16": DType.BFLOAT16, "torch.float16": DType.FLOAT16, "torch.float32": DType.FLOAT32,
           "torch.float8_e4m3fn": DType.FLOAT8_E4M3, "torch.float8_e5m2": DType.FLOAT8_E5M2,
           "torch.uint8": DType.UINT8}


@dataclass
class LayerViews:
    """One layer read from its tensor: the region views and what the tensor says of its layout."""

    views: list[Any]
    region_layout: str  # kvsvc's: packed_kv, split_kv, or "latent" for MLA
    memory_layout: str  # HND or NHD
    kernel_block: int  # tokens per block of the tensor (vLLM's kernel block)
    num_blocks: int  # blocks of the tensor (kernel blocks)


def _refuse(message: str, **meta: object) -> FailedPrecondition:
    return FailedPrecondition(Reason.UNSUPPORTED_KV_LAYOUT, message, {k: str(v) for k, v in meta.items()})


def _dtype(t: Any) -> DType:
    return _dtype_of(str(t.dtype))


def _dtype_of(name: str, layer: str = "") -> DType:
    if name not in _DTYPES:
        raise _refuse(f"KV dtype {name} is not supported" + (f" (layer {layer})" if layer else ""), dtype=name)
    return _DTYPES[name]


def _layer_compact(name: str, t: Any, block_bytes: int) -> None:
    """A block of the layer must be one dense run of the region's bytes (a layer-compact,
    unpadded layout); kvsvc's regions step by exactly one block."""
    stride = int(t.stride(0)) * t.element_size()
    if t.shape[0] > 1 and stride != block_bytes:
        raise _refuse(f"layer {name}: its blocks lie {stride} bytes apart but hold {block_bytes} (vLLM's KV cache "
                      f"layout interleaves layers inside a block, such as BLHNC, or pads pages); kvsvc needs a "
                      f"layer-compact layout: KvsvcConnector asks vLLM for LBHNC, so a backend that cannot use it "
                      f"decides here; set VLLM_KV_CACHE_LAYOUT=LBHNC (or LBNHC for equal TP only)",
                      layer=name, block_stride_bytes=stride, block_bytes=block_bytes)


def _attention_views(name: str, t: Any, spec: Any) -> LayerViews:
    """The region views of one attention layer's tensor, and the layout its strides say."""
    heads, hs = spec.num_kv_heads, spec.head_size
    hv = getattr(spec, "head_size_v", None) or hs
    e = t.element_size()
    if t.dim() == 4 and t.shape[1] == heads and t.shape[3] == hs + hv:
        # vLLM's logical [blocks, heads, tokens, K+V]; the strides say which of heads and
        # tokens is outer. One head: both orders are the same bytes.
        hnd = heads == 1 or t.stride(1) >= t.stride(2)
        view = t if hnd else t.transpose(1, 2)  # physical order: each block one dense run
        _layer_compact(name, view, heads * t.shape[2] * (hs + hv) * e)
        return LayerViews([view], "packed_kv", "HND" if hnd else "NHD", int(t.shape[2]), int(t.shape[0]))
    if t.dim() == 5 and t.shape[0] == 2 and hs == hv and t.shape[3] == heads and t.shape[4] == hs:
        # Split K/V: [2, blocks, tokens, heads, head_size], the physical order in the strides.
        hnd = heads > 1 and t.stride(3) > t.stride(2)
        k, v = t[0], t[1]
        if hnd:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        _layer_compact(name, k, heads * t.shape[2] * hs * e)
        return LayerViews([k, v], "split_kv", "HND" if hnd else "NHD", int(t.shape[2]), int(t.shape[1]))
    raise _refuse(f"layer {name}: KV tensor of shape {tuple(t.shape)} is not a layout kvsvc knows "
                  f"(heads {heads}, block {spec.block_size}, head sizes {hs}/{hv}; kvsvc reads [blocks, heads, "
                  f"tokens, {hs + hv}] and [2, blocks, tokens, heads, {hs}])", layer=name, shape=tuple(t.shape))


def _latent_views(name: str, t: Any, spec: Any) -> LayerViews:
    """An MLA layer as [blocks, tokens, head_size]: GPU backends allocate it so, vLLM's logical
    view and the CPU backend with a head axis of one ([blocks, 1, tokens, head_size])."""
    hs = spec.head_size
    if t.dim() == 3 and t.shape[2] == hs:
        view = t
    elif t.dim() == 4 and t.shape[3] == hs and 1 in (t.shape[1], t.shape[2]):
        view = t.flatten(1, 2)  # a view: the axis of one adds no stride
    else:
        raise _refuse(f"MLA layer {name}: tensor of shape {tuple(t.shape)} (block {spec.block_size}, latent {hs})",
                      layer=name, shape=tuple(t.shape))
    _layer_compact(name, view, int(view.shape[1]) * hs * t.element_size())
    return LayerViews([view], "latent", "HND", int(view.shape[1]), int(view.shape[0]))


def _state_views(name: str, t: Any, spec: MambaSpec) -> tuple[list[Any], int]:
    """A Mamba layer's state regions (each state's bytes of every block) and its page (bytes
    from one block to the next). vLLM hands a hybrid model's Mamba layer to a connector as the
    raw bytes of its pages, [blocks, ..., state bytes] stepping by the page it padded to the
    attention page; the states lie back to back at each page's start, in the spec's order."""
    lens = spec.state_bytes()
    e = t.element_size()
    flat = t.flatten(1) if t.dim() > 1 else None
    if flat is None or int(flat.shape[1]) * e != sum(lens) or not flat[0].is_contiguous():
        raise _refuse(f"Mamba layer {name}: tensor of shape {tuple(t.shape)} does not hold its states' {sum(lens)} "
                      f"bytes a block (states {list(spec.shapes)})", layer=name, shape=tuple(t.shape))
    raw = flat if e == 1 else flat.view(_torch_uint8())  # byte offsets: a view of the bytes
    offsets = itertools.accumulate(lens[:-1], initial=0)
    return [raw[:, at:at + n] for at, n in zip(offsets, lens, strict=True)], int(t.stride(0)) * e


def _torch_uint8() -> Any:
    import torch  # the engine's process has it; kvsvc's pure layers do not import it

    return torch.uint8


def _mamba_spec(name: str, spec: Any, block: int) -> MambaSpec:
    """kvsvc's spec of a vLLM Mamba group (its page set once the layers' tensors say it),
    refused where kvsvc cannot move its state whole: state kept per block for prefix caching
    (mamba_cache_mode other than "none") or scratch blocks for speculative decoding."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "none":
        raise _refuse(f"Mamba group {name}: vLLM keeps its state with mamba_cache_mode {mode!r}; kvsvc moves a "
                      "hybrid model's state with 'none' (run it with --no-enable-prefix-caching)",
                      group=name, mamba_cache_mode=mode)
    if getattr(spec, "num_speculative_blocks", 0):
        raise _refuse(f"Mamba group {name}: speculative decoding's state blocks are not moved by kvsvc",
                      group=name, num_speculative_blocks=spec.num_speculative_blocks)
    dtypes = tuple(_dtype_of(str(dt), name) for dt in spec.dtypes)
    return MambaSpec(block, tuple(tuple(int(d) for d in shape) for shape in spec.shapes), dtypes)


def _blocks_per_logical(name: str, spec: Any, kernel_block: int) -> int:
    if kernel_block <= 0 or spec.block_size % kernel_block:
        raise _refuse(f"layer {name}: kernel blocks of {kernel_block} tokens do not divide vLLM's block of "
                      f"{spec.block_size}", layer=name, kernel_block=kernel_block, block_size=spec.block_size)
    return spec.block_size // kernel_block


def kernel_block_ids(block_ids: Any, blocks_per_logical: int) -> list[list[int]]:
    """vLLM's block ids (per group) as the kernel block ids kvsvc's layout counts: block b is
    kernel blocks b*n .. b*n+n-1 (vLLM's own split, which keeps token order)."""
    n = blocks_per_logical
    if n == 1:
        return [[int(b) for b in group] for group in block_ids]
    return [[int(b) * n + j for b in group for j in range(n)] for group in block_ids]


def _spec(kind: str, spec: Any, block: int, dtype: DType) -> KVCacheSpec:
    """kvsvc's spec of a vLLM group (its spec's per-rank heads, kvsvc's block: the kernel block)."""
    if kind == "MLAAttentionSpec":
        return MLAAttentionSpec(block, 1, spec.head_size, dtype)
    if kind == "SlidingWindowSpec":
        return SlidingWindowSpec(block, spec.num_kv_heads, spec.head_size, dtype, spec.sliding_window)
    return FullAttentionSpec(block, spec.num_kv_heads, spec.head_size, dtype, getattr(spec, "head_size_v", 0) or 0)


def describe(kv_caches: Mapping[str, Any], kv_cache_config: Any, *, model_id: str, total_num_kv_heads: int,
             dcp_size: int = 1) -> CacheDescription:
    """The kvsvc layout of one worker's caches and the views to register, in kvsvc's region
    order (the server's config checks the layout against the engine's TP size)."""
    groups: list[tuple[str, str, Any, int]] = []  # (name, vLLM's spec type, its spec, layers)
    buffers: list[Any] = []
    region = memory = None
    facts: dict[str, Any] = {}  # what every layer must share: blocks, dtype, kernel block, split
    states: dict[int, MambaSpec] = {}  # per Mamba group, kvsvc's spec (with the page every layer has)
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, names = group.kv_cache_spec, list(group.layer_names)
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec"):
            raise _refuse(f"KV cache group {gi} is {kind}; kvsvc's vLLM connector moves full, sliding-window "
                          "and MLA attention and Mamba state", group=gi, spec=kind)
        if kind == "MambaSpec":
            states[gi] = _mamba_spec(f"g{gi}", spec, 0)
        for name in names:
            if name not in kv_caches:
                raise _refuse(f"layer {name} of group {gi} has no KV tensor", layer=name)
            t = kv_caches[name]
            if kind == "MambaSpec":
                views, page = _state_views(name, t, states[gi])
                if states[gi].page_bytes not in (0, page) or facts.setdefault("blocks", int(t.shape[0])) != t.shape[0]:
                    raise _refuse(f"Mamba layer {name}: {t.shape[0]} pages of {page} bytes, unlike the other layers",
                                  layer=name, blocks=int(t.shape[0]), page_bytes=page)
                states[gi] = dataclasses.replace(states[gi], page_bytes=page)
                buffers.extend(views)
                continue
            lv = _latent_views(name, t, spec) if kind == "MLAAttentionSpec" else _attention_views(name, t, spec)
            if lv.region_layout != "latent":
                if (region or lv.region_layout, memory or lv.memory_layout) != (lv.region_layout, lv.memory_layout):
                    raise _refuse("layers use different KV layouts", layer=name)
                region, memory = lv.region_layout, lv.memory_layout
            these = {"blocks": lv.num_blocks, "dtype": _dtype(t), "kernel block": lv.kernel_block,
                     "kernel blocks per block": _blocks_per_logical(name, spec, lv.kernel_block)}
            differ = [k for k, v in these.items() if facts.setdefault(k, v) != v]
            if differ:
                raise _refuse(f"layer {name} differs from the others in {', '.join(differ)}: kvsvc describes one "
                              "block geometry per engine", layer=name, **{k.replace(" ", "_"): these[k]
                                                                          for k in differ})
            buffers.extend(lv.views)
        groups.append((f"g{gi}", kind, spec, len(names)))
    if not groups:
        raise _refuse("the engine has no KV cache groups")
    if "kernel block" not in facts:
        raise _refuse("the engine has no attention layer: kvsvc moves Mamba state beside attention (hybrid models)")
    per_logical = facts["kernel blocks per block"]
    if states and per_logical > 1:
        raise _refuse(f"the attention backend splits each block into {per_logical} kernel blocks; a hybrid model's "
                      f"Mamba pages are vLLM's blocks: run it with --block-size equal to the kernel block "
                      f"({facts['kernel block']})", kernel_block=facts["kernel block"])
    if per_logical > 1 and dcp_size > 1:
        raise _refuse(f"decode context parallelism interleaves tokens by vLLM's block, and the attention backend "
                      f"splits each block into {per_logical} kernel blocks: run DCP with --block-size equal to "
                      f"the kernel block ({facts['kernel block']})", dcp_size=dcp_size,
                      kernel_block=facts["kernel block"])
    block, dtype = facts["kernel block"], facts["dtype"]
    layout = EngineLayout(
        model_id=model_id, total_num_kv_heads=total_num_kv_heads, block_size=block, num_blocks=facts["blocks"],
        groups=numbered_groups([LayerGroup(name, dataclasses.replace(states[gi], block_size=block) if gi in states
                                           else _spec(kind, spec, block, dtype), n)
                                for gi, (name, kind, spec, n) in enumerate(groups)]),
        kv_memory_layout=KvMemoryLayout(memory or "HND"), region_layout=RegionLayout(region or "split_kv"),
        dcp_size=dcp_size)
    return CacheDescription(layout, buffers, per_logical)


STREAMED_KINDS = ("FullAttentionSpec", "MLAAttentionSpec")


def stream_block_size(kv_cache_config: Any) -> tuple[int, str]:
    """(vLLM's block size in tokens, "") when this engine's requests can be streamed chunk by
    chunk -- every group full or MLA attention, of one block size: a request's block list
    then only grows while it prefills -- else (0, why not). A sliding-window group lets
    blocks go mid-prefill, which a D still reading them must never see."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return 0, "the engine has no KV cache groups"
    kinds = {type(g.kv_cache_spec).__name__ for g in groups}
    if not kinds <= set(STREAMED_KINDS):
        return 0, f"KV cache groups of {sorted(kinds - set(STREAMED_KINDS))} are not streamed (only full and MLA attention)"
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(sizes) != 1:
        return 0, f"KV cache groups use different block sizes {sorted(sizes)}"
    return sizes.pop(), ""
