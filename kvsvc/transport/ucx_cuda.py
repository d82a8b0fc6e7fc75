"""What UCX needs before it moves GPU memory the way kvsvc moves it: READs, from the NIXL thread.

Measured on an H200 (one GPU, no NVLink; benchmarks/nixl_vram_probe.py, a 256 MiB READ
between two processes): UCX's default left cuda_ipc out of READs ("cuda-ipc get zcopy
disabled as no nvlinks detected") and served them by "software emulation" over TCP
through host memory at 0.37-0.47 GB/s; with cuda_ipc READs allowed the same READ ran at
1,707 GB/s (verified byte for byte). UCX turns them off without NVLink because a pull over
PCIe peer-to-peer can be slower than a push; kvsvc pulls by design, and any cuda_ipc READ
beats the fallback by three orders of magnitude, so it allows them unless the operator
chose otherwise.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CUDA_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def allow_cuda_ipc_reads() -> None:
    """Let UCX serve READs of GPU memory with cuda_ipc (call before UCX reads its environment,
    i.e. before the process's first NIXL agent). An operator's own setting is kept."""
    if CUDA_IPC_GET in os.environ:
        log.info("%s=%s kept as set", CUDA_IPC_GET, os.environ[CUDA_IPC_GET])
        return
    os.environ[CUDA_IPC_GET] = "y"


def bind_cuda_device(device: int) -> None:
    """Make the device's CUDA context current on the calling thread (the NIXL thread, which
    never ran CUDA code itself). UCX's CUDA transports work in the context current on the
    thread that registers memory and posts READs; on the H200 above the READ's transport and
    speed came out the same either way, so this follows UCX's documented requirement rather
    than a measured failure."""
    import torch  # VRAM pools exist only where torch has CUDA

    torch.cuda.set_device(device)
