"""SGLang's CPU workarounds for the tests, as an SGLang plugin (entry-point group
`sglang.srt.plugins`, declared by the dist-info beside this file, found because the tests put
this directory on PYTHONPATH). Never part of kvsvc's product path: on a GPU none is needed.

- SGLang's tensor-parallel groups open NCCL communicators; without a GPU they must not.
- SGLang's NIXL backend registers and describes KV memory as "VRAM" (decode hard-codes it);
  UCX refuses host memory registered as VRAM, so on a machine without a GPU every "VRAM"
  NIXL sees from SGLang's processes is "DRAM".
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def _dram_instead_of_vram(method: Any) -> Any:
    where = list(inspect.signature(method).parameters).index("mem_type")

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mem_type") == "VRAM":
            kwargs["mem_type"] = "DRAM"
        elif len(args) > where and args[where] == "VRAM":
            args = (*args[:where], "DRAM", *args[where + 1:])
        return method(*args, **kwargs)

    return wrapper


def apply() -> None:
    import torch

    if torch.cuda.is_available():
        return
    _no_nccl_on_cpu()
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return
    for name in ("register_memory", "deregister_memory", "get_xfer_descs", "get_reg_descs", "prep_xfer_dlist"):
        method = getattr(nixl_agent, name, None)
        if method is not None and "mem_type" in inspect.signature(method).parameters \
                and not getattr(method, "_kvsvc_cpu_fixture", False):
            wrapped = _dram_instead_of_vram(method)
            wrapped._kvsvc_cpu_fixture = True
            setattr(nixl_agent, name, wrapped)


def _no_nccl_on_cpu() -> None:
    """SGLang's TP groups open a NCCL communicator unless told not to, which needs a CUDA
    device: without one, TP > 1 runs its collectives over gloo alone."""
    from sglang.srt.distributed import parallel_state

    original = parallel_state.init_model_parallel_group
    if getattr(original, "_kvsvc_cpu_fixture", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_pynccl") is None and len(args) < 4:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    wrapper._kvsvc_cpu_fixture = True
    parallel_state.init_model_parallel_group = wrapper
