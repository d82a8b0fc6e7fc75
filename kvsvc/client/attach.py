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

    def close(self) -> None:
        """Drop this handle's reference; the mapping goes when no view of it is left."""
        self.buffer = None

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach_pool(info: pb.PoolInfo) -> AttachedPool:
    return AttachedPool(info)


def _open_cuda(info: pb.PoolInfo) -> Any:
    """Open a VRAM pool from its CUDA IPC handle as a flat uint8 torch tensor."""
    import torch
    from cuda.bindings import runtime

    handle = runtime.cudaIpcMemHandle_t()
    handle.reserved = bytes(info.cuda_ipc_handle)
    err, = runtime.cudaSetDevice(info.device_id)[:1]
    err, ptr = runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaIpcOpenMemHandle failed: {err}")

    class _Cai:
        __cuda_array_interface__ = {"shape": (info.size_bytes,), "typestr": "|u1",
                                    "data": (int(ptr) + info.cuda_ipc_offset_bytes, False), "version": 3}

    return torch.as_tensor(_Cai(), device=f"cuda:{info.device_id}")
