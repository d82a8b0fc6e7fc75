"""SGLang's KV pools, as its KVArgs describe them to a transfer backend, in kvsvc's layout model.

SGLang hands a backend addresses, not tensors: for an MHA pool every layer's K buffer,
then every layer's V buffer (kv_data_ptrs), each a run of pages (kv_item_lens bytes a page)
with the tokens of a page outermost and [heads, head_dim] inside each token: NHD. An MLA
pool has one latent buffer per layer, [tokens, 1, kv_lora_rank + qk_rope_head_dim]. A
kvsvc block is one SGLang page; its block ids are SGLang's page indices (page 0 is the
pool's padding page, never handed out).

Pure: reads numbers, imports no SGLang, torch, grpc or NIXL. The layout says the bytes of
a head's row, not its element type (the table's dtype is uint8 and head_size counts
bytes): SGLang's KV dtype travels in the model id, so P and D with different KV dtypes
are refused by kvsvc's compatibility check rather than mixing bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import FailedPrecondition
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


@dataclass
class SGLangCacheDescription:
    """kvsvc's layout table for the server's config, and one buffer per region in region order."""

    table: dict[str, Any]
    buffers: list[AddressRange]


def _refuse(message: str, **meta: object) -> FailedPrecondition:
    return FailedPrecondition(Reason.UNSUPPORTED_KV_LAYOUT, message, {k: str(v) for k, v in meta.items()})


def _ranges(p: SGLangPools) -> list[AddressRange]:
    n = len(p.kv_data_ptrs)
    if not n or len(p.kv_data_lens) != n or len(p.kv_item_lens) != n:
        raise _refuse(f"SGLang described {n} KV buffers with {len(p.kv_data_lens)} lengths and "
                      f"{len(p.kv_item_lens)} page sizes", buffers=n)
    out = []
    for i, (ptr, length, item) in enumerate(zip(p.kv_data_ptrs, p.kv_data_lens, p.kv_item_lens, strict=True)):
        if item <= 0 or length % item:
            raise _refuse(f"KV buffer {i}: {length} bytes is not a whole number of {item}-byte pages",
                          buffer=i, bytes=length, page_bytes=item)
        out.append(AddressRange(int(ptr), int(length) // int(item), int(item), p.device))
    if len({r.rows for r in out}) != 1:
        raise _refuse("SGLang's KV buffers hold different page counts: kvsvc describes one page geometry "
                      "per engine", pages=sorted({r.rows for r in out}))
    return out


def describe(p: SGLangPools) -> SGLangCacheDescription:
    """The layout of one SGLang worker's KV pools and the region buffers to register, in place."""
    if p.page_size <= 0:
        raise _refuse(f"page size {p.page_size}", page_size=p.page_size)
    ranges = _ranges(p)
    num_pages = ranges[0].rows
    common = {"model_id": p.model_id, "block_size": p.page_size, "num_blocks": num_pages, "dtype": "uint8",
              "region_layout": "split_kv", "dcp_size": 1}
    if p.is_mla:
        latent = {r.row_bytes for r in ranges}
        if len(latent) != 1 or next(iter(latent)) % p.page_size:
            raise _refuse("MLA layers differ in latent size", sizes=sorted(latent))
        head_bytes = next(iter(latent)) // p.page_size
        table = {**common, "total_num_kv_heads": 1, "kv_memory_layout": "HND",
                 "groups": [{"name": "mla", "kind": "mla", "num_layers": len(ranges), "head_size": head_bytes}]}
        return SGLangCacheDescription(table, ranges)
    if len(ranges) % 2:
        raise _refuse(f"an MHA pool gives K and V buffers per layer; SGLang gave {len(ranges)} buffers",
                      buffers=len(ranges))
    layers = len(ranges) // 2
    keys, values = ranges[:layers], ranges[layers:]
    heads = max(1, p.total_num_kv_heads // p.tp_size)  # SGLang replicates heads when TP > K, as kvsvc does
    sizes = []
    for kind, half in (("K", keys), ("V", values)):
        row = {r.row_bytes for r in half}
        if len(row) != 1 or next(iter(row)) % (p.page_size * heads):
            raise _refuse(f"{kind} buffers of {sorted(row)} bytes a page do not split into {p.page_size} tokens of "
                          f"{heads} heads", page_bytes=sorted(row), page_size=p.page_size, heads=heads)
        sizes.append(next(iter(row)) // (p.page_size * heads))
    # One page of one token is the same bytes in NHD and HND (heads contiguous): kvsvc splits
    # heads between TP sizes as for HND; a larger page is read a token row at a time.
    table = {**common, "total_num_kv_heads": p.total_num_kv_heads, "kv_memory_layout": "NHD",
             "groups": [{"name": "kv", "kind": "full_attention", "num_layers": layers, "head_size": sizes[0],
                         "head_size_v": sizes[1]}]}
    # kvsvc's region order is layer by layer, K then V.
    return SGLangCacheDescription(table, [b for pair in zip(keys, values, strict=True) for b in pair])
