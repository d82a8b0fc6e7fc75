"""SGLang's KV pools, as its KVArgs describe them to a transfer backend, in kvsvc's layout model.

SGLang hands a backend addresses, not tensors: for an MHA pool every layer's K buffer,
then every layer's V buffer (kv_data_ptrs), each a run of pages (kv_item_lens bytes a page)
with the tokens of a page outermost and [heads, head_dim] inside each token: NHD. An MLA
pool has one latent buffer per layer, [tokens, 1, kv_lora_rank + qk_rope_head_dim]. A
kvsvc block is one SGLang page; its block ids are SGLang's page indices (page 0 is the
pool's padding page, never handed out). A hybrid-SWA model's sliding-window layers live in a
pool of their own (SGLang's SWA state component), described as a second group.

Pure: reads numbers, imports no SGLang, torch, grpc or NIXL. The layout says the bytes of
a head's row, not its element type (the layout's dtype is uint8 and head_size counts
bytes): SGLang's KV dtype travels in the model id, so P and D with different KV dtypes
are refused by kvsvc's compatibility check rather than mixing bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsvc.errors import FailedPrecondition
from kvsvc.integrations.description import CacheDescription, LayerGroup, numbered_groups
from kvsvc.layout.engine import EngineLayout, KvMemoryLayout, RegionLayout
from kvsvc.layout.specs import DType, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, per_rank_heads
from kvsvc.memory.pools import AddressRange
from kvsvc.reasons import Reason


@dataclass(frozen=True)
class SGLangPools:
    """What one SGLang TP worker says of its KV (KVArgs), plus what it knows of the model."""

    kv_data_ptrs: Sequence[int]
    kv_data_lens: Sequence[int]
    kv_item_lens: Sequence[int]
    page_size: int
    is_mla: bool
    total_num_kv_heads: int  # the model's KV heads (1 for MLA)
    tp_size: int  # attention TP size: heads are split (or replicated) over it
    model_id: str
    device: int | None = None  # CUDA device of the pools; None: host memory
    swa: SGLangWindowPool | None = None  # the sliding-window pool of a hybrid-SWA model


@dataclass(frozen=True)
class SGLangWindowPool:
    """A hybrid-SWA model's sliding-window pool: SGLang's SWA state component (its buffers
    as for the KV pool: every SWA layer's K, then V) and the window in tokens."""

    data_ptrs: Sequence[int]
    data_lens: Sequence[int]
    item_lens: Sequence[int]
    window: int


def _refuse(message: str, **meta: object) -> FailedPrecondition:
    return FailedPrecondition(Reason.UNSUPPORTED_KV_LAYOUT, message, {k: str(v) for k, v in meta.items()})


def _ranges(ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], device: int | None,
            what: str = "KV") -> list[AddressRange]:
    n = len(ptrs)
    if not n or len(lens) != n or len(items) != n:
        raise _refuse(f"SGLang described {n} {what} buffers with {len(lens)} lengths and {len(items)} page sizes",
                      buffers=n)
    out = []
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        if item <= 0 or length % item:
            raise _refuse(f"{what} buffer {i}: {length} bytes is not a whole number of {item}-byte pages",
                          buffer=i, bytes=length, page_bytes=item)
        out.append(AddressRange(int(ptr), int(length) // int(item), int(item), device))
    if len({r.rows for r in out}) != 1:
        raise _refuse(f"SGLang's {what} buffers hold different page counts: kvsvc describes one page geometry "
                      "per pool", pages=sorted({r.rows for r in out}))
    return out


def _mha_group(ranges: list[AddressRange], page_size: int, heads: int,
               what: str) -> tuple[tuple[int, int, int], list[AddressRange]]:
    """A group of MHA layers from SGLang's buffers (every layer's K, then every layer's V):
    (K row bytes, V row bytes, layers) and its buffers in kvsvc's region order (layer by
    layer, K then V)."""
    if len(ranges) % 2:
        raise _refuse(f"an MHA pool gives K and V buffers per layer; SGLang gave {len(ranges)} {what} buffers",
                      buffers=len(ranges))
    layers = len(ranges) // 2
    keys, values = ranges[:layers], ranges[layers:]
    sizes = []
    for kind, half in (("K", keys), ("V", values)):
        row = {r.row_bytes for r in half}
        if len(row) != 1 or next(iter(row)) % (page_size * heads):
            raise _refuse(f"{what} {kind} buffers of {sorted(row)} bytes a page do not split into {page_size} "
                          f"tokens of {heads} heads", page_bytes=sorted(row), page_size=page_size, heads=heads)
        sizes.append(next(iter(row)) // (page_size * heads))
    return (sizes[0], sizes[1], layers), [b for pair in zip(keys, values, strict=True) for b in pair]


def describe(p: SGLangPools) -> CacheDescription:
    """The layout of one SGLang worker's KV pools and the region buffers to register, in place.

    With a sliding-window pool (p.swa) its layers are a second group, "swa", with a block
    count of its own (SGLang sizes that pool apart from the full one); a request's block ids
    for it are the pages of the window SGLang sends (its SWA state indices)."""
    if p.page_size <= 0:
        raise _refuse(f"page size {p.page_size}", page_size=p.page_size)
    ranges = _ranges(p.kv_data_ptrs, p.kv_data_lens, p.kv_item_lens, p.device)
    block, u8 = p.page_size, DType.UINT8

    def layout(total_heads: int, memory: KvMemoryLayout, groups: list[LayerGroup]) -> EngineLayout:
        return EngineLayout(model_id=p.model_id, total_num_kv_heads=total_heads, block_size=block,
                            num_blocks=ranges[0].rows, groups=numbered_groups(groups), kv_memory_layout=memory,
                            region_layout=RegionLayout.SPLIT_KV)

    if p.is_mla:
        if p.swa is not None:
            raise _refuse("a sliding-window pool beside an MLA pool")
        latent = {r.row_bytes for r in ranges}
        if len(latent) != 1 or next(iter(latent)) % p.page_size:
            raise _refuse("MLA layers differ in latent size", sizes=sorted(latent))
        head_bytes = next(iter(latent)) // p.page_size
        mla = LayerGroup("mla", MLAAttentionSpec(block, 1, head_bytes, u8), len(ranges))
        return CacheDescription(layout(1, KvMemoryLayout.HND, [mla]), ranges)
    heads = per_rank_heads(p.total_num_kv_heads, p.tp_size)  # SGLang replicates heads when TP > K, as kvsvc does
    (k_bytes, v_bytes, layers), buffers = _mha_group(ranges, p.page_size, heads, "KV")
    groups = [LayerGroup("kv", FullAttentionSpec(block, heads, k_bytes, u8, v_bytes), layers)]
    if p.swa is not None:
        swa_ranges = _ranges(p.swa.data_ptrs, p.swa.data_lens, p.swa.item_lens, p.device, "sliding-window")
        (swa_k, swa_v, swa_layers), swa_buffers = _mha_group(swa_ranges, p.page_size, heads, "sliding-window")
        if p.swa.window <= 0:
            raise _refuse(f"sliding window of {p.swa.window} tokens", sliding_window=p.swa.window)
        if swa_k != swa_v:
            raise _refuse("sliding-window K and V rows differ in size", key=swa_k)
        groups.append(LayerGroup("swa", SlidingWindowSpec(block, heads, swa_k, u8, p.swa.window), swa_layers,
                                 swa_ranges[0].rows))
        buffers += swa_buffers
    # One page of one token is the same bytes in NHD and HND (heads contiguous): kvsvc splits
    # heads between TP sizes as for HND; a larger page is read a token row at a time.
    return CacheDescription(layout(p.total_num_kv_heads, KvMemoryLayout.NHD, groups), buffers)
