"""What SGLang's kvsvc backend reads of the SGLang process it runs in, beyond KVArgs: what it
cannot move (refused at start), the model's KV heads, a hybrid-SWA model's window pool and
pages, and the secret an engine's attention-TP ranks share."""

from __future__ import annotations

import os
import secrets
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, StateType
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_disagg, get_parallel
from sglang.srt.server_args import ServerArgs

from kvsvc.integrations.sglang.layout import SGLangWindowPool


def unsupported(args: KVArgs, mode: DisaggregationMode) -> list[str]:
    """What this backend does not move, from the engine's own description of its state."""
    parallel = get_parallel()
    why = []
    state_types = getattr(args, "state_types", None) or []
    others = [s for s in state_types if s != StateType.SWA]
    if others:
        why.append(f"hybrid state ({', '.join(str(getattr(s, 'value', s)) for s in others)})")
    elif state_types and getattr(args, "swa_kv_cache_layout", None) is None:
        why.append("a sliding-window pool that is not an MHA pool")
    if getattr(args, "num_draft_entries", 0):
        why.append("draft-model KV (speculative decoding)")
    for name, size in (("pipeline", parallel.pp_size), ("context", parallel.attn_cp_size),
                       ("decode-context", parallel.attn_dcp_size)):
        if size > 1:
            why.append(f"{name} parallelism ({size})")
    if getattr(parallel, "enable_kv_cache_sharding", False):
        why.append("KV cache sharding")
    if getattr(args, "host_kv_data_ptrs", None) and mode == DisaggregationMode.DECODE:
        why.append("host KV destinations")
    if os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL") == "INTRA_NODE_NVLINK":
        why.append("aux buffers in GPU memory (SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK)")
    if get_disagg().disaggregation_decode_allocation_policy == "prefill_complete":
        why.append("--disaggregation-decode-allocation-policy prefill_complete")
    return why


def total_kv_heads(args: KVArgs, server_args: ServerArgs, is_mla: bool) -> int:
    if is_mla:
        return 1
    total = getattr(args, "total_kv_head_num", 0)
    if total:
        return int(total)
    from sglang.srt.configs.model_config import ModelConfig

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def window_pool(args: KVArgs, server_args: ServerArgs) -> SGLangWindowPool | None:
    """The sliding-window pool of a hybrid-SWA model (SGLang's SWA state component), if any."""
    if StateType.SWA not in (getattr(args, "state_types", None) or []):
        return None
    from sglang.srt.configs.model_config import ModelConfig

    i = args.state_types.index(StateType.SWA)
    window = ModelConfig.from_server_args(server_args).sliding_window_size or 0
    return SGLangWindowPool(args.state_data_ptrs[i], args.state_data_lens[i], args.state_item_lens[i], int(window))


def window_pages(state_indices: Any, state_types: list[Any]) -> np.ndarray | None:
    """The window's pages among SGLang's state indices (one entry per state type)."""
    if state_indices is None or StateType.SWA not in state_types:
        return None
    pages = state_indices[state_types.index(StateType.SWA)]
    return None if pages is None else np.asarray(pages, dtype=np.int64).reshape(-1)


def engine_secret(tp_size: int) -> bytes:
    """A secret every attention-TP rank of this engine holds (lease tokens derive from it, so
    the ranks' leases of one request share a token without a word between them per request)."""
    secret = secrets.token_bytes(32)
    if tp_size > 1:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        secret = get_attn_tp_group().broadcast_object(secret, src=0)
    return secret
