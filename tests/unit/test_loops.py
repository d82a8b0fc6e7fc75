"""A loop on its own thread stops with nothing left pending on it (kvsvc/loops.py).

What it guards against: a task left pending when its loop closed is finalised later by the
garbage collector, in whatever code runs then; a gRPC server's coroutines then call into the
closed loop and raise there (seen failing an unrelated test). So the checks collect garbage
after the stop and look at what Python reports as unraisable.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import grpc

from kvsvc.client import Client
from kvsvc.integrations.loop import LoopThread


class Unraisable:
    """Everything sys.unraisablehook is given while in use."""

    def __enter__(self) -> list[str]:
        self.seen: list[str] = []
        self._old = sys.unraisablehook
        sys.unraisablehook = lambda u: self.seen.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
        return self.seen

    def __exit__(self, *exc: object) -> None:
        gc.collect()
        sys.unraisablehook = self._old


def test_a_pending_task_is_cancelled_on_the_live_loop_before_it_closes():
    ended = threading.Event()
    on_loop: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:  # runs on the loop, while it still runs
            on_loop.append(asyncio.get_running_loop().is_running())
            ended.set()

    with Unraisable() as seen:
        lt = LoopThread("test-pending")
        started = lt.submit(forever())
        lt.stop()
        assert ended.is_set() and on_loop == [True]
        assert started.cancelled()
        assert lt.loop.is_closed()
        lt.stop()  # idempotent
    assert seen == []


def test_a_grpc_server_stopped_just_before_its_loop_leaves_nothing_to_finalise():
    """grpc.aio's server needs turns of its loop after stop() returns; stopping the loop at
    once left its main-loop task pending (and its coroutines raising later in the collector)."""
    with Unraisable() as seen:
        for _ in range(5):
            lt = LoopThread("test-grpc")

            async def serve() -> grpc.aio.Server:
                server = grpc.aio.server()
                server.add_insecure_port("127.0.0.1:0")
                await server.start()
                return server

            server = lt.run(serve(), 30)
            lt.run(server.stop(0), 30)
            lt.stop()
            del server
    assert seen == []


def test_the_sync_client_stops_its_loop_the_same_way():
    with Unraisable() as seen:
        client = Client("127.0.0.1:1")  # nothing listens: the channel is made, never used
        client.close()
        client.close()
    assert seen == []
