"""Time each connector's request_finished inside a vLLM engine, unmodified (for benchmarks/vllm_load.py).

With this directory on PYTHONPATH and KVSVC_BENCH_FINISH_TIMES set to a file, every Python
process of the engine wraps KvsvcConnector's and NixlConnector's request_finished (and
request_finished_all_groups) as their modules load, and appends each outermost call's
duration in seconds to the file, one line each, after timing it. The connectors keep their
names, so vLLM treats them exactly as in production (it special-cases "NixlConnector").
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

TARGETS = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector": "NixlConnector",
    "kvsvc.integrations.vllm.connector": "KvsvcConnector",
}
_depth = threading.local()


def _timed(path: str, orig):
    def call(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        t0 = time.perf_counter()
        try:
            return orig(self, *args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            _depth.n = depth
            if depth == 0:  # one request's call, not an inner delegation
                with open(path, "a") as f:
                    f.write(f"{elapsed:.9f}\n")
    return call


class _Wrapper(importlib.abc.MetaPathFinder):
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name, import_path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            cls = getattr(module, TARGETS[name])  # NixlConnector is an alias of NixlPullConnector
            for method in ("request_finished", "request_finished_all_groups"):
                found = getattr(cls, method, None)  # may be inherited: wrapped on the class itself
                if found is not None:
                    setattr(cls, method, _timed(self.path, found))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("KVSVC_BENCH_FINISH_TIMES"):
    sys.meta_path.insert(0, _Wrapper(os.environ["KVSVC_BENCH_FINISH_TIMES"]))
