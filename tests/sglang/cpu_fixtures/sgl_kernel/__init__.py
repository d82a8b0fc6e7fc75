"""A stand-in for sgl-kernel's CPU build, for SGLang's CPU path in tests only.

With SGLANG_USE_CPU_ENGINE=1 SGLang imports a few CPU ops from `sgl_kernel` at import time;
they exist only in sgl-kernel's CPU build, which is built from source (PyPI's sglang-kernel
needs libcuda). These are the two the prefill/decode path runs, in plain torch, on this
directory put on PYTHONPATH by the SGLang tests (never in anything a GPU deployment loads).
Any other name imports (SGLang imports a few speculative-decoding ops at start-up) but
raises when called, naming itself, so a path that needs more fails loudly.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Request i's new token slots (its run of out_cache_loc, requests concatenated in order)
    into row req_pool_indices[i] of req_to_token, columns start_offset[i]:end_offset[i]."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every buffer (base address data_ptrs[i], strides[i] bytes a token slot), the slot
    src_loc[j] copied to tgt_loc[j]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in the CPU stand-in (tests/sglang/cpu_fixtures)")

    missing.__name__ = name
    return missing
