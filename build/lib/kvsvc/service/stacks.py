"""Where a running server is waiting: thread stacks and asyncio task chains, on demand.

`kill -USR1 <pid>` makes a server write every thread's stack to stderr at once (even
with the event loop stuck: faulthandler runs in the signal handler) and then, from the
event loop, one log line per task naming each coroutine it is suspended in, down to the
future it waits for. A transfer that outlives its deadline logs its own chain the same way.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

MAX_CHAIN = 64  # coroutines followed per task (a chain is a few dozen deep at most)


def await_chain(task: asyncio.Task[Any]) -> str:
    """'func file:line <- ...' for each coroutine the task is suspended in, innermost last,
    then what the innermost one awaits."""
    parts: list[str] = []
    aw: Any = task.get_coro()
    for _ in range(MAX_CHAIN):
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None) or getattr(aw, "gi_frame", None)
        if frame is None:
            break
        parts.append(f"{frame.f_code.co_name} {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        nxt = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None) or getattr(aw, "gi_yieldfrom", None)
        if nxt is None:
            break
        aw = nxt
    if aw is not None and not hasattr(aw, "cr_frame") and not hasattr(aw, "ag_frame"):
        parts.append(f"awaiting {type(aw).__name__}")
    return " -> ".join(parts) or "(not started)"


def log_tasks() -> None:
    """One line per pending task of the running loop: its name and await chain."""
    tasks = [t for t in asyncio.all_tasks() if not t.done()]
    log.warning("%d asyncio tasks pending", len(tasks))
    for t in sorted(tasks, key=lambda t: t.get_name()):
        log.warning("task %s: %s", t.get_name(), await_chain(t))


def install_stack_dump(loop: asyncio.AbstractEventLoop, sig: int = signal.SIGUSR1) -> None:
    """sig dumps thread stacks (faulthandler, immediately) then task chains (from the loop)."""
    loop.add_signal_handler(sig, log_tasks)
    # chain=True: after the dump, the handler above still runs.
    faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=True)
