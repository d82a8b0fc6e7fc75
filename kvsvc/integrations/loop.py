"""An event loop on its own thread: where an engine process runs kvsvc's asyncio code.

vLLM's and SGLang's schedulers and workers are synchronous; the embedded server, its NIXL
data plane and the gRPC clients live on this loop and share nothing with the model's
thread but the KV memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvsvc.loops import stop_loop_thread

T = TypeVar("T")

STALL_WARN_S = 1.0


def _unpin_this_thread() -> None:
    """Let this thread (and the threads it starts: NIXL's) run on any core.

    An engine pins its worker process to the cores its compute threads own (vLLM's CPU
    workers: one core each); inherited, that pin puts kvsvc's I/O behind the model's
    threads on a busy core, where it was seen to stall for tens of seconds.
    """
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # 0: the calling thread on Linux
    except (AttributeError, OSError):
        pass


class LoopThread:
    def __init__(self, name: str, log: logging.Logger | None = None) -> None:
        """log: where stalls are reported (the engine's logger, so its handlers apply)."""
        self._log = log or logging.getLogger("kvsvc.engine")
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # the client side may run without uvloop
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _unpin_this_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule coro on the loop; the future completes when it does."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run coro on the loop and wait for its result (from another thread only)."""
        return self.submit(coro).result(timeout_s)

    async def watch_stalls(self, tick_s: float = 0.1) -> None:
        """Warn when this loop did not run for a while: everything kvsvc does here waits with it."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick_s)
            late = time.monotonic() - before - tick_s
            if late > STALL_WARN_S:
                self._log.warning("kvsvc: event loop %s stalled %.1f s", self._thread.name, late)

    def stop(self) -> None:
        """Cancel what still runs on the loop (the stall watch, what a server left), then stop it."""
        stop_loop_thread(self.loop, self._thread)
