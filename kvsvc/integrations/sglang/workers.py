"""The backend's own threads, each stopped by whoever started it: the listener on the
manager's ZMQ socket and P's lease worker. Neither polls with a timeout to notice a stop:
the listener is woken through an in-process ZMQ pair, the worker by a last job.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("sglang.kvsvc")


class Listener:
    """Hands every message that arrives on socket to handle, one at a time, in a thread of
    its own, until stop(). The socket is read by that thread alone (ZMQ sockets are not
    thread-safe); handle's exceptions are logged, never end the thread."""

    def __init__(self, context: zmq.Context[Any], socket: zmq.Socket[Any], handle: Callable[[list[bytes]], None],
                 name: str) -> None:
        self._socket, self._handle = socket, handle
        address = f"inproc://kvsvc-listener-stop-{id(self)}"
        self._stop_in = context.socket(zmq.PAIR)
        self._stop_in.bind(address)
        self._stop_out = context.socket(zmq.PAIR)
        self._stop_out.connect(address)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_in in ready:
                    return
                msg = self._socket.recv_multipart()
                try:
                    self._handle(msg)
                except Exception:
                    log.exception("kvsvc: handling a %r message failed", msg[0][:24] if msg else b"")
        finally:
            self._stop_in.close(linger=0)

    def stop(self, timeout_s: float) -> bool:
        """Wake the thread and wait for it; True once it ended (the socket is free to close)."""
        if self._thread.is_alive():
            self._stop_out.send(b"")
            self._thread.join(timeout_s)
        self._stop_out.close(linger=0)
        return not self._thread.is_alive()


_STOP = object()


class Worker:
    """Runs each job put to it with run(job), in order, in a thread of its own, until stop().
    run handles its own failures; one that escapes is logged and the worker goes on."""

    def __init__(self, run: Callable[[Any], None], name: str) -> None:
        self._run_job = run
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, job: Any) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            try:
                self._run_job(job)
            except Exception:
                log.exception("kvsvc: a job of %s failed", self._thread.name)

    def stop(self, timeout_s: float) -> bool:
        """End the thread after the jobs already put; True once it ended."""
        self._jobs.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()
