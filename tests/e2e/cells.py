"""The e2e matrix: every supported TP / layout case as a cell, and the refused ones.

Each cell is moved for real between two server processes and checked byte for byte
against kvsvc.verify, with release accounting and descriptor counts recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.e2e.harness import layout_table

SSM = {"name": "ssm", "kind": "mamba", "num_layers": 1, "states": [{"shape": [16, 2]}, {"shape": [16, 3]}]}
SWA = {"name": "swa", "kind": "sliding_window", "num_layers": 1, "head_size": 4, "sliding_window": 8}
DSV4 = [{"name": "mla-grouped", "kind": "uniform", "layers": [
    {"kind": "mla", "head_size": 8}, {"kind": "mla", "head_size": 4}, {"kind": "mla", "head_size": 16}]}]


@dataclass
class Cell:
    """One transfer: P and D TP sizes and layouts, block ids per group, what D already holds."""

    id: str
    category: str
    p_tp: int
    d_tp: int
    p_layout: dict[str, Any]
    d_layout: dict[str, Any] | None = None
    p_ids: list[list[int]] = field(default_factory=lambda: [[5, 9, 2, 11]])
    d_ids: list[list[int]] = field(default_factory=lambda: [[0, 3, 4, 7]])
    first_position: list[int] | None = None


def gqa(k: int, **kw: Any) -> dict[str, Any]:
    return layout_table(k=k, **kw)


def mla(**kw: Any) -> dict[str, Any]:
    return layout_table(mla=True, head=8, **kw)


FAST: list[Cell] = [
    # equal TP
    Cell("eq-1-1", "equal", 1, 1, gqa(4)),
    Cell("eq-2-2", "equal", 2, 2, gqa(4)),
    Cell("eq-4-4-k2", "equal", 4, 4, gqa(2)),
    Cell("eq-2-2-nhd", "equal", 2, 2, gqa(4, kv_memory_layout="NHD")),
    # NHD pages of one token (SGLang's default): heads contiguous, so heads split as under HND
    Cell("p2-2-1-nhd-page1", "p>d / NHD page of 1", 2, 1, gqa(4, block=1, kv_memory_layout="NHD")),
    Cell("d2-1-2-nhd-page1", "d>p / NHD page of 1", 1, 2, gqa(4, block=1, kv_memory_layout="NHD")),
    Cell("p2-2-1-nhd1-hnd", "p>d / NHD page of 1 to HND", 2, 1, gqa(4, block=1, kv_memory_layout="NHD"),
         gqa(4, block=1)),
    # NHD blocks of many tokens with heads split (SGLang's larger pages, vLLM's LBNHC), and
    # the two memory orders paired: a token row at a time
    Cell("p2-2-1-nhd", "p>d / NHD", 2, 1, gqa(4, kv_memory_layout="NHD")),
    Cell("d2-1-2-nhd", "d>p / NHD", 1, 2, gqa(4, kv_memory_layout="NHD")),
    Cell("eq-2-2-nhd-hnd", "equal / NHD to HND", 2, 2, gqa(4, kv_memory_layout="NHD"), gqa(4)),
    Cell("d2-1-2-hnd-nhd", "d>p / HND to NHD", 1, 2, gqa(4), gqa(4, kv_memory_layout="NHD")),
    # D > P at ratios 2, 4, 8
    Cell("d2-1-2", "d>p", 1, 2, gqa(4)),
    Cell("d4-1-4", "d>p", 1, 4, gqa(8)),
    Cell("d8-1-8", "d>p", 1, 8, gqa(8)),
    Cell("d2-2-4-k16", "d>p", 2, 4, gqa(16)),
    Cell("d4-1-4-k2", "d>p / K<TP", 1, 4, gqa(2)),  # D replicates heads
    Cell("d2-4-8-k4", "d>p / K<TP", 4, 8, gqa(4)),  # vLLM rejects this valid case
    Cell("d2-8-16-k8", "d>p / K<TP", 8, 16, gqa(8)),  # vLLM rejects this valid case
    # P > D at ratios 2, 4, 8
    Cell("p2-2-1", "p>d", 2, 1, gqa(4)),
    Cell("p4-4-1", "p>d", 4, 1, gqa(8)),
    Cell("p8-8-1", "p>d", 8, 1, gqa(8)),
    Cell("p2-4-2-k16", "p>d", 4, 2, gqa(16)),
    Cell("p2-2-1-k1", "p>d / K<TP", 2, 1, gqa(1)),  # GQA dedup: P ranks hold one head
    Cell("p2-4-2-k2", "p>d / K<TP", 4, 2, gqa(2)),  # dense P>D, replicated P heads: release accounting
    Cell("p4-8-2-k2", "p>d / K<TP", 8, 2, gqa(2)),
    # MLA
    Cell("mla-p2-2-1", "mla p>d", 2, 1, mla()),
    Cell("mla-p4-4-1", "mla p>d", 4, 1, mla()),
    Cell("mla-p4-8-2", "mla p>d", 8, 2, mla()),  # D rank t reads P rank 4t, notifies the rest
    Cell("mla-d2-1-2", "mla d>p", 1, 2, mla()),
    Cell("mla-d2-2-4", "mla d>p", 2, 4, mla()),
    # hybrid SSM + attention
    Cell("ssm-p2-2-1", "hybrid ssm", 2, 1, gqa(4, extra=[SSM]), p_ids=[[5, 9], [1]], d_ids=[[0, 3], [2]]),
    Cell("ssm-d2-1-2", "hybrid ssm", 1, 2, gqa(4, extra=[SSM]), p_ids=[[5, 9], [1]], d_ids=[[0, 3], [2]]),
    Cell("ssm-p4-4-1-k2", "hybrid ssm", 4, 1, gqa(2, extra=[SSM]), p_ids=[[5], [1, 2]], d_ids=[[0], [6, 7]]),
    # sliding window next to full attention
    Cell("swa-p2-2-1", "sliding window", 2, 1, gqa(4, extra=[SWA]), p_ids=[[1, 2], [3, 4]], d_ids=[[5, 6], [7, 8]]),
    Cell("swa-d2-1-2", "sliding window", 1, 2, gqa(4, extra=[SWA]), p_ids=[[1, 2], [3, 4]], d_ids=[[5, 6], [7, 8]]),
    # A pool of its own per group (SGLang's sliding-window pool is smaller than its full one),
    # sized differently on P and D; the window group lists only its window's blocks.
    Cell("swa-own-pool-p2-2-1", "sliding window / pool per group", 2, 1, gqa(4, extra=[dict(SWA, num_blocks=6)]),
         gqa(4, nb=40, extra=[dict(SWA, num_blocks=12)]), p_ids=[[1, 2, 30, 31], [5, 3]], d_ids=[[5, 6, 38, 39], [11, 10]]),
    # grouped specs (DeepSeek-V4-like: MLA layers with different page sizes)
    Cell("dsv4-p2-2-1", "grouped specs", 2, 1, layout_table(groups=DSV4)),
    Cell("dsv4-d2-1-2", "grouped specs", 1, 2, layout_table(groups=DSV4)),
    # region layouts
    Cell("bf-p2-2-1-mixed", "regions", 2, 1, gqa(4, region_layout="blocks_first"), gqa(4, region_layout="split_kv")),
    Cell("bf-d2-1-2", "regions", 1, 2, gqa(4, region_layout="blocks_first")),
    # prefix-cache hits: D already holds the first blocks
    Cell("prefix-1-1", "prefix hit", 1, 1, gqa(4), p_ids=[[1, 2, 3, 4, 5]], d_ids=[[8, 9]], first_position=[3]),
    Cell("prefix-p2-2-1", "prefix hit", 2, 1, gqa(4), p_ids=[[1, 2, 3, 4]], d_ids=[[9]], first_position=[3]),
    # local block a multiple of the remote one
    Cell("blk2-1-1", "block ratio", 1, 1, gqa(4, block=4), gqa(4, block=8), p_ids=[[1, 2, 3, 4]], d_ids=[[5, 6]]),
    Cell("blk2-p2-2-1", "block ratio", 2, 1, gqa(4, block=4), gqa(4, block=8), p_ids=[[3, 4, 1, 2]], d_ids=[[6, 2]]),
    Cell("blk4-d2-1-2-nhd", "block ratio", 2, 2, gqa(4, block=2, kv_memory_layout="NHD"),
         gqa(4, block=8, kv_memory_layout="NHD"), p_ids=[[1, 2, 3, 4, 5, 6, 7, 8]], d_ids=[[3, 0]]),
    Cell("blk2-mla-p2-2-1", "block ratio", 2, 1, mla(block=4), mla(block=8), p_ids=[[1, 2, 3, 4]], d_ids=[[5, 6]]),
]


@dataclass
class Refusal:
    """A pair kvsvc must refuse at handshake, with the reason and the values it must name."""

    id: str
    p_tp: int
    d_tp: int
    p_layout: dict[str, Any]
    d_layout: dict[str, Any]
    reason: str
    metadata: dict[str, str] = field(default_factory=dict)


REFUSALS: list[Refusal] = [
    Refusal("remote-block-larger", 1, 1, gqa(4, block=8), gqa(4, block=4), "BLOCK_SIZE_MISMATCH",
            {"local_block_size": "4", "remote_block_size": "8"}),
    Refusal("tp-not-divisible", 2, 3, gqa(6), gqa(6), "TP_NOT_DIVISIBLE", {"local_tp_size": "3", "remote_tp_size": "2"}),
    Refusal("dtype", 1, 1, gqa(4), gqa(4, dtype="float16", head=8), "DTYPE_MISMATCH",
            {"local_dtype": "float16", "remote_dtype": "float32"}),
    Refusal("head-size", 1, 1, gqa(4, head=8), gqa(4, head=4), "HEAD_SIZE_MISMATCH",
            {"local_head_size": "4", "remote_head_size": "8"}),
    Refusal("layer-count", 1, 1, gqa(4, layers=2), gqa(4, layers=3), "LAYER_COUNT_MISMATCH",
            {"local_layers": "3", "remote_layers": "2"}),
    Refusal("model", 1, 1, gqa(4), dict(gqa(4), model_id="other"), "MODEL_MISMATCH",
            {"local_model_id": "other", "remote_model_id": "e2e"}),
    Refusal("region-count", 1, 1, gqa(4, extra=[SSM]),
            gqa(4, extra=[dict(SSM, states=[{"shape": [16, 2]}])]), "REGION_COUNT_MISMATCH",
            {"local_regions": "1", "remote_regions": "2"}),
    Refusal("kv-heads", 1, 1, gqa(4), gqa(8), "KV_HEADS_MISMATCH",
            {"local_total_num_kv_heads": "8", "remote_total_num_kv_heads": "4"}),
]

FULL: list[Cell] = [
    Cell(f"sweep-{'mla' if is_mla else f'k{k}'}-{p}-{d}", "sweep", p, d, mla() if is_mla else gqa(k))
    for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) for k, is_mla in ((1, False), (8, False), (0, True))
]
