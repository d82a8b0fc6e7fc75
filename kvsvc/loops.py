"""Stopping an event loop that runs on its own thread, leaving nothing of it behind.

A loop stopped while tasks are still pending on it (a gRPC server's main loop that needs one
more turn after its stop, a watchdog that never ends) leaves those coroutines to the garbage
collector; once the loop is closed, finalising them runs their cleanup against a closed loop,
which raises inside whatever code the collector happened to interrupt. So a loop is stopped
the way asyncio.run ends: every task left is cancelled and waited for, then async
generators are shut down, and only then does the loop stop and close.

And the other way: a thread that reports to a loop (`tell`) may outlive it (a stop that gave
up waiting for the thread): what it reports then is dropped, never raised in the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvsvc.loops")

DRAIN_ROUNDS = 3  # a cancelled task may start others (gRPC's shutdown does): look again
DRAIN_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 10.0


def tell(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """Run fn on loop (from another thread). A loop closed meanwhile -- its server stopped while a
    job or READ of it was still here -- has nobody left waiting: nothing is told, and the
    thread goes on rather than die on it."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
        log.debug("a call for a closed event loop was dropped: %s", getattr(fn, "__name__", fn))


async def cancel_pending_tasks(timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Cancel every task of the running loop but the caller's and wait for them to end
    (bounded); returns how many were still pending when the wait gave up."""
    me = asyncio.current_task()
    left: set[asyncio.Task[object]] = set()
    for _ in range(DRAIN_ROUNDS):
        tasks = {t for t in asyncio.all_tasks() if t is not me and not t.done()}
        if not tasks:
            break
        for task in tasks:
            task.cancel()
        done, left = await asyncio.wait(tasks, timeout=timeout_s)
        for task in done:  # looked at, so asyncio does not log "exception never retrieved"
            if not task.cancelled():
                task.exception()
        if left:
            break
    await asyncio.get_running_loop().shutdown_asyncgens()
    return len(left)


def stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                     timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Drain loop (run by thread, which runs loop.run_forever), stop it, join the thread and
    close the loop; from any thread but thread itself. Idempotent."""
    if loop.is_closed():
        return
    if thread.is_alive():
        future = asyncio.run_coroutine_threadsafe(cancel_pending_tasks(timeout_s), loop)
        try:
            left = future.result(timeout_s + JOIN_TIMEOUT_S)
            if left:
                log.warning("kvsvc: %d task(s) on loop %s did not end when cancelled", left, thread.name)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("kvsvc: loop %s did not drain", thread.name, exc_info=True)
        loop.call_soon_threadsafe(loop.stop)  # a loop not yet running stops after its first turn
    thread.join(JOIN_TIMEOUT_S)
    if not thread.is_alive():
        loop.close()
