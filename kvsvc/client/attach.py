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

    def kv(self, region: pb.RegionInfo, layout: pb.KvLayout | None = None) -> Any:
        """A region as the engine sees its cache: see typed_view (layout: no longer needed, as
        the region says its own block shape and type)."""
        del layout
        return typed_view(self.buffer, region)

    def close(self) -> None:
        """Drop this handle's reference; the mapping goes when no view of it is left."""
        self.buffer = None

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def typed_view(buffer: Any, region: pb.RegionInfo) -> Any:
    """One region of a flat uint8 pool (numpy array or torch tensor), typed and shaped as the
    region says (RegionInfo.block_shape and dtype).

    Attention: [num_blocks, heads, tokens, head_size] (HND) or [num_blocks, tokens, heads,
    head_size] (NHD), the last dimension K+V for packed_kv; MLA: [num_blocks, tokens, head_size]; Mamba state: [num_blocks,
    *state_shape]. numpy has no bfloat16, so bf16 comes as uint16 bits there (torch gives
    bfloat16). The view has exact strides (the block stride outside, C order inside): it
    aliases the pool, never a copy.
    """
    shape, dtype = _region_shape(region)
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


def _region_shape(region: pb.RegionInfo) -> tuple[tuple[int, ...], Any]:
    """(per-block shape, Dtype) of a region, as the server describes it (the same for every
    kind of layer: nothing here knows attention from MLA or Mamba)."""
    if not region.block_shape or region.dtype == pb.DTYPE_UNSPECIFIED:
        raise ValueError(f"region {region.region_index} has no block_shape or dtype: the server is older than this "
                         "client (kvsvc 0.x before RegionInfo.block_shape); upgrade it")
    return tuple(region.block_shape), region.dtype


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
