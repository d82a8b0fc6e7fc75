"""Map a server's KV pool into this process, the way an engine would: numpy (DRAM) or torch (VRAM).

    pool = attach_pool(info.pools[0])           # from GetInfo
    k0 = pool.region(info.pools[0].regions[0])   # [num_blocks, block_len] uint8 view
    pool.close()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsvc.v1 import kv_transfer_pb2 as pb


class AttachedPool:
    """A mapped pool. .buffer is a flat uint8 numpy array (DRAM) or torch tensor (VRAM)."""

    def __init__(self, info: pb.PoolInfo) -> None:
        self.info = info
        if info.memory_kind == pb.MEMORY_KIND_DRAM:
            from kvsvc.memory.pools import attach_shm

            self.buffer: Any = attach_shm(info.shm_name, info.size_bytes)
        elif info.memory_kind == pb.MEMORY_KIND_VRAM:
            self.buffer = _open_cuda(info)
        else:
            raise ValueError(f"pool of rank {info.tp_rank} has no memory kind")

    def region(self, region: pb.RegionInfo) -> Any:
        """[num_blocks, block_len] view of one region's blocks (strided for blocks-first halves)."""
        start, stride, length = region.pool_offset_bytes, region.block_stride_bytes, region.block_len_bytes
        n = region.num_blocks
        if isinstance(self.buffer, np.ndarray):
            return np.lib.stride_tricks.as_strided(self.buffer[start:], shape=(n, length), strides=(stride, 1),
                                                   writeable=True)
        return self.buffer[start:].as_strided((n, length), (stride, 1))

    def kv(self, region: pb.RegionInfo, layout: pb.KvLayout) -> Any:
        """A region as the engine sees its cache: see typed_view."""
        return typed_view(self.buffer, region, layout, self.info.regions)

    def close(self) -> None:
        """Drop this handle's reference; the mapping goes when no view of it is left."""
        self.buffer = None

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def typed_view(buffer: Any, region: pb.RegionInfo, layout: pb.KvLayout, regions: Any) -> Any:
    """One region of a flat uint8 pool (numpy array or torch tensor), typed and shaped from the layout.

    Attention: [num_blocks, heads, tokens, head_size] (HND) or [num_blocks, tokens, heads,
    head_size] (NHD), the last dimension K+V for packed_kv; MLA: [num_blocks, tokens, head_size]; Mamba state: [num_blocks,
    *state_shape]. numpy has no bfloat16, so bf16 comes as uint16 bits there (torch gives
    bfloat16). The view has exact strides (the block stride outside, C order inside): it
    aliases the pool, never a copy.
    """
    shape, dtype = _region_shape(region, layout, regions)
    inner = [1]
    for dim in reversed(shape[1:]):
        inner.insert(0, inner[0] * dim)
    start, n = region.pool_offset_bytes, region.num_blocks
    if isinstance(buffer, np.ndarray):
        np_dtype = np.dtype(_NUMPY_DTYPES[dtype])
        size = np_dtype.itemsize
        usable = (buffer.size - start) // size * size
        return np.lib.stride_tricks.as_strided(buffer[start:start + usable].view(np_dtype), shape=(n, *shape),
                                               strides=(region.block_stride_bytes, *(i * size for i in inner)),
                                               writeable=True)
    import torch

    tdt = getattr(torch, _TORCH_DTYPES[dtype])
    size = torch.empty(0, dtype=tdt).element_size()
    usable = (buffer.numel() - start) // size * size
    return buffer[start:start + usable].view(tdt).as_strided((n, *shape), (region.block_stride_bytes // size, *inner))


_NUMPY_DTYPES: dict[int, str] = {pb.DTYPE_FLOAT16: "float16", pb.DTYPE_BFLOAT16: "uint16", pb.DTYPE_FLOAT32: "float32",
                 pb.DTYPE_FLOAT8_E4M3: "uint8", pb.DTYPE_FLOAT8_E5M2: "uint8", pb.DTYPE_UINT8: "uint8"}
_TORCH_DTYPES: dict[int, str] = {pb.DTYPE_FLOAT16: "float16", pb.DTYPE_BFLOAT16: "bfloat16", pb.DTYPE_FLOAT32: "float32",
                 pb.DTYPE_FLOAT8_E4M3: "float8_e4m3fn", pb.DTYPE_FLOAT8_E5M2: "float8_e5m2", pb.DTYPE_UINT8: "uint8"}


def _layer_spec(layout: pb.KvLayout, region: pb.RegionInfo) -> pb.KvCacheSpec:
    spec = layout.groups[region.group_index].spec
    if spec.WhichOneof("kind") == "uniform_type":
        return next(layer.spec for layer in spec.uniform_type.layers if layer.layer_name == region.layer_name)
    return spec


def _region_shape(region: pb.RegionInfo, layout: pb.KvLayout, all_regions: Any) -> tuple[tuple[int, ...], Any]:
    """(per-block shape, DType) of a region, from the layout GetInfo returned alongside it."""
    spec = _layer_spec(layout, region)
    kind = spec.WhichOneof("kind")
    tokens = layout.block_size_tokens
    if kind == "mla_attention":
        return (tokens, spec.mla_attention.head_size), spec.mla_attention.dtype
    if kind == "mamba":
        # A Mamba layer's state regions come in state order; count this one among them.
        state = sum(1 for r in all_regions if r.layer_name == region.layer_name and r.region_index < region.region_index)
        st = spec.mamba.states[state]
        return tuple(st.shape), st.dtype
    attn = spec.full_attention if kind == "full_attention" else spec.sliding_window
    head = attn.head_size
    if region.kind == pb.REGION_KIND_VALUE and kind == "full_attention" and spec.full_attention.head_size_v:
        head = spec.full_attention.head_size_v
    if region.kind == pb.REGION_KIND_KV:  # K then V of each token inside each head
        head += (spec.full_attention.head_size_v or head) if kind == "full_attention" else head
    heads = attn.num_kv_heads_per_rank
    hnd = layout.kv_memory_layout == pb.KV_MEMORY_LAYOUT_HND
    return ((heads, tokens, head) if hnd else (tokens, heads, head)), attn.dtype


def attach_pool(info: pb.PoolInfo) -> AttachedPool:
    return AttachedPool(info)


def _open_cuda(info: pb.PoolInfo) -> Any:
    """Open a VRAM pool shared with torch's CUDA IPC as a flat uint8 torch tensor."""
    import torch

    ipc = info.cuda_ipc
    torch.cuda._lazy_init()  # as torch.multiprocessing's rebuild_cuda_tensor does
    storage = torch.UntypedStorage._new_shared_cuda(
        info.device_id, ipc.handle, ipc.storage_size_bytes, ipc.storage_offset_bytes,
        ipc.ref_counter_handle, ipc.ref_counter_offset, ipc.event_handle, ipc.event_sync_required)
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info.device_id}")
    return tensor.set_(storage, 0, (info.size_bytes,), (1,))
