"""KV pools a server owns: DRAM in named POSIX shared memory, VRAM as CUDA tensors, or an engine's own buffers."""

from __future__ import annotations

import enum
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError
from kvsvc.layout.regions import Region
from kvsvc.reasons import Reason

log = logging.getLogger(__name__)


class MemoryKind(enum.StrEnum):
    """Where a pool lives; the values are NIXL's own names for the two kinds."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class Pool:
    """One rank's pool: a contiguous byte range the regions of build_pool_layout live in."""

    memory_kind = MemoryKind.DRAM
    populate_s = 0.0  # time spent backing every page at start (pools kvsvc allocates itself)
    shm_name = ""
    device_id = 0
    cuda_ipc: tuple[Any, ...] | None = None  # torch's (device, handle, size, offset, refcount..., event...)

    def __init__(self, rank: int, size_bytes: int, base_address: int) -> None:
        self.rank = rank
        self.size_bytes = size_bytes
        self.base_address = base_address

    def region_address(self, region: Region) -> int:
        """Address of the region's block 0."""
        return self.base_address + region.pool_offset

    def segments(self) -> list[tuple[int, int]]:
        """(address, bytes) spans to register with NIXL: every region lies inside one."""
        return [(self.base_address, self.size_bytes)]

    def close(self) -> None:
        """Release the memory; idempotent."""


class ShmPool(Pool):
    """DRAM pool in a named shared-memory segment an engine process can map (and NIXL reads)."""

    def __init__(self, rank: int, size_bytes: int, name: str) -> None:
        try:
            self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(name=name, create=True,
                                                                                      size=size_bytes)
        except FileExistsError as e:
            raise FailedPrecondition(Reason.POOL_EXISTS, f"shared memory {name} already exists", {"shm_name": name}) from e
        self._array = np.frombuffer(self._shm.buf, dtype=np.uint8, count=size_bytes)  # type: ignore[arg-type]
        super().__init__(rank, size_bytes, int(self._array.ctypes.data))
        self.shm_name = name
        try:
            self.populate_s = self._populate()
        except BaseException:
            self.close()
            raise
        log.info("pool of rank %d: %.1f MiB in /dev/shm/%s, every page backed in %.1f ms", rank,
                 size_bytes / 2**20, name.lstrip("/"), self.populate_s * 1e3)

    def _populate(self) -> float:
        """Back every page now, and map it here; returns the seconds it took.

        A READ into never-touched pages pays a page fault and a zeroed page per 4 KiB, several
        times the wire time of a small transfer; engines would pay it on every first use of a
        block. And a /dev/shm too small for the pool fails here, clearly, rather than with a
        SIGBUS on the first write into a page it cannot back.
        """
        t0 = time.perf_counter()
        fd = os.open(f"/dev/shm/{self.shm_name.lstrip('/')}", os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, self.size_bytes)
        except OSError as e:
            raise KvsvcError(Reason.POOL_NO_MEMORY, f"cannot back a {self.size_bytes}-byte pool in /dev/shm: "
                             f"{os.strerror(e.errno or 0)}", {"shm_name": self.shm_name, "bytes": self.size_bytes},
                             code=ErrorCode.RESOURCE_EXHAUSTED) from e
        finally:
            os.close(fd)
        self._array[:: mmap.PAGESIZE] = 0  # the pages are allocated; this maps them into this process
        return time.perf_counter() - t0

    @property
    def array(self) -> np.ndarray:
        return self._array

    def close(self) -> None:
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        del self._array  # the exported buffer must go before the mapping can close
        try:
            shm.close()
        except BufferError:
            log.warning("pool %s still has views; unlinking anyway", self.shm_name)
        shm.unlink()


class CudaPool(Pool):
    """VRAM pool: a torch CUDA tensor, shared with engines through a CUDA IPC handle."""

    memory_kind = MemoryKind.VRAM

    def __init__(self, rank: int, size_bytes: int, device: int, wrap: bool = False) -> None:
        """wrap: device is a default (one GPU per rank): fold it onto the devices present."""
        torch: Any
        try:
            import torch  # server-side only; clients never import torch through kvsvc
        except ImportError:
            torch = None
        if torch is None or not torch.cuda.is_available():
            why = "torch is not installed" if torch is None else (
                "this torch is a CPU build" if not torch.backends.cuda.is_built() else "no CUDA device is visible")
            raise FailedPrecondition(Reason.CUDA_UNAVAILABLE, f'memory = "vram" needs a CUDA device, and {why}; on a '
                                     'machine without a GPU use memory = "dram" (--memory dram)',
                                     {"rank": rank, "device": device})
        if wrap:
            device %= max(1, torch.cuda.device_count())
        if not 0 <= device < torch.cuda.device_count():
            raise FailedPrecondition(Reason.CUDA_UNAVAILABLE, f"CUDA device {device} of rank {rank} does not exist "
                                     f"(this machine has {torch.cuda.device_count()})",
                                     {"rank": rank, "device": device})
        self._tensor: Any = torch.zeros(size_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        super().__init__(rank, size_bytes, int(self._tensor.data_ptr()))
        self.device_id = device
        # The same sharing torch.multiprocessing uses; an engine opens it with attach_pool.
        self.cuda_ipc = tuple(self._tensor.untyped_storage()._share_cuda_())

    @property
    def tensor(self) -> Any:
        return self._tensor

    def close(self) -> None:
        self._tensor = None


class ExternalPool(Pool):
    """An engine's own contiguous buffer (numpy array or torch tensor), not owned by kvsvc."""

    def __init__(self, rank: int, buffer: Any, size_bytes: int) -> None:
        if hasattr(buffer, "data_ptr"):  # torch tensor
            nbytes = buffer.numel() * buffer.element_size()
            addr, cuda = int(buffer.data_ptr()), buffer.is_cuda
            contiguous = buffer.is_contiguous()
            device = (buffer.device.index or 0) if cuda else 0
        else:
            arr = np.asarray(buffer)
            nbytes, addr, cuda, contiguous, device = arr.nbytes, int(arr.ctypes.data), False, arr.flags.c_contiguous, 0
        if not contiguous or nbytes < size_bytes:
            raise InvalidArgument(Reason.POOL_TOO_SMALL,
                                  f"rank {rank}: the engine buffer must be contiguous and hold {size_bytes} bytes "
                                  f"(has {nbytes})", {"rank": rank, "needed_bytes": size_bytes, "bytes": nbytes})
        super().__init__(rank, size_bytes, addr)
        self._buffer = buffer
        if cuda:
            self.memory_kind, self.device_id = MemoryKind.VRAM, device

    def close(self) -> None:
        self._buffer = None


@dataclass(frozen=True, slots=True)
class AddressRange:
    """Engine memory handed over as addresses, not objects: rows of row_bytes from address on.

    How SGLang describes its KV pools to a transfer backend (KVArgs: a base pointer, a byte
    length and an item length per buffer). device None: host memory; else the CUDA device.
    The engine keeps the memory alive for as long as the server runs.
    """

    address: int
    rows: int
    row_bytes: int
    device: int | None = None


def _buffer_facts(buffer: Any) -> tuple[int, int, int, int, bool, int]:
    """(address, dim-0 length, dim-0 stride bytes, bytes of one dim-0 item, is CUDA, device) of a tensor or array."""
    if isinstance(buffer, AddressRange):
        cuda = buffer.device is not None
        return buffer.address, buffer.rows, buffer.row_bytes, buffer.row_bytes, cuda, buffer.device or 0
    if hasattr(buffer, "data_ptr"):  # torch tensor
        e = buffer.element_size()
        rows = int(buffer.shape[0]) if buffer.dim() else 1
        stride = int(buffer.stride(0)) * e if buffer.dim() else e
        item = int(buffer[0].numel()) * e if buffer.dim() and rows else e
        inner_ok = buffer.dim() < 2 or buffer[0].is_contiguous()
        cuda = bool(buffer.is_cuda)
        return int(buffer.data_ptr()), rows, stride, item if inner_ok else -1, cuda, (buffer.device.index or 0) if cuda \
            else 0
    arr = np.asarray(buffer)
    if arr.ndim == 0:
        return int(arr.ctypes.data), 1, arr.itemsize, arr.itemsize, False, 0
    inner_ok = arr.ndim < 2 or arr[0].flags.c_contiguous
    return int(arr.ctypes.data), arr.shape[0], arr.strides[0], arr[0].nbytes if inner_ok else -1, False, 0


class RegionBuffersPool(Pool):
    """An engine's own memory given region by region: one tensor, array or AddressRange per region, indexed by block.

    How engines such as vLLM hold KV: a tensor per layer, blocks on dimension 0 (a view
    per region where a layer has several, e.g. K and V). Each buffer must hold the
    region's blocks at the region's block stride, each block contiguous.
    """

    def __init__(self, rank: int, regions: tuple[Region, ...], buffers: Any) -> None:
        buffers = list(buffers)
        if len(buffers) != len(regions):
            raise InvalidArgument(Reason.POOL_MISMATCH, f"rank {rank}: {len(buffers)} buffers for {len(regions)} regions "
                                  "(one per region, in region order)",
                                  {"rank": rank, "buffers": len(buffers), "regions": len(regions)})
        self._buffers = buffers
        self._addresses: list[int] = []
        kinds = set()
        for r, buf in zip(regions, buffers, strict=True):
            addr, rows, stride, item, cuda, device = _buffer_facts(buf)
            if rows < r.num_blocks or (rows > 1 and stride != r.block_stride) or item < r.block_len:
                raise InvalidArgument(
                    Reason.POOL_MISMATCH,
                    f"rank {rank} region {r.index} ({r.layer_name} {r.kind.value}): the buffer must hold "
                    f"{r.num_blocks} contiguous blocks of {r.block_len} bytes every {r.block_stride} bytes; it has "
                    f"{rows} of {item} bytes every {stride}",
                    {"rank": rank, "region": r.index, "blocks": rows, "block_stride": stride, "block_bytes": item})
            self._addresses.append(addr)
            kinds.add((cuda, device))
        if len(kinds) > 1:
            raise InvalidArgument(Reason.POOL_MISMATCH, f"rank {rank}: the region buffers sit on different devices",
                                  {"rank": rank})
        (cuda, device), = kinds
        spans = sorted((a, a + r.extent) for a, r in zip(self._addresses, regions, strict=True))
        merged: list[list[int]] = []
        for lo, hi in spans:  # views of one tensor (K and V of a layer) may touch or interleave
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._segments = [(lo, hi - lo) for lo, hi in merged]
        super().__init__(rank, sum(n for _, n in self._segments), merged[0][0] if merged else 0)
        if cuda:
            self.memory_kind, self.device_id = MemoryKind.VRAM, device

    def region_address(self, region: Region) -> int:
        return self._addresses[region.index]

    def segments(self) -> list[tuple[int, int]]:
        return list(self._segments)

    def close(self) -> None:
        self._buffers = []


def shm_name_for(engine_id: str, epoch: int, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:40]
    return f"kvsvc-{safe}-{epoch & 0xFFFFFFFF:08x}-r{rank}"


def attach_shm(name: str, size_bytes: int) -> np.ndarray:
    """Map an existing segment as a flat uint8 array.

    np.memmap unmaps when the last view is gone, so no close() can fail on live views,
    and no resource tracker of this process unlinks the server's segment at exit.
    """
    try:
        return np.memmap(f"/dev/shm/{name.lstrip('/')}", dtype=np.uint8, mode="r+", shape=(size_bytes,))
    except FileNotFoundError as e:
        raise FailedPrecondition(Reason.POOL_NOT_FOUND, f"shared memory {name} does not exist (server stopped?)",
                                 {"shm_name": name}) from e


__all__ = ["AddressRange", "CudaPool", "ExternalPool", "Pool", "RegionBuffersPool", "ShmPool", "attach_shm", "shm_name_for"]
