"""The SGLang backend's own threads (integrations/sglang/workers.py) end when told: the
listener on a real ZMQ socket (woken, not polled) and P's lease worker (after the jobs
already put). A handler or job that raises ends neither. Waits on events, bounded."""

from __future__ import annotations

import queue
import threading

import zmq

from kvsvc.integrations.sglang.workers import Listener, Worker

WAIT_S = 30.0


def test_the_listener_hands_on_every_message_survives_a_failing_one_and_stops_when_told():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    heard: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()

    def handle(msg: list[bytes]) -> None:
        heard.put(msg)
        if msg[0] == b"bad":
            raise ValueError("a handler that fails")

    listener = Listener(ctx, pull, handle, "test-listener")
    listener.start()
    try:
        for frames in ([b"one", b"x"], [b"bad"], [b"two"]):
            push.send_multipart(frames)
        assert [heard.get(timeout=WAIT_S) for _ in range(3)] == [[b"one", b"x"], [b"bad"], [b"two"]]
        threads = {t.name for t in threading.enumerate()}
        assert "test-listener" in threads
    finally:
        assert listener.stop(WAIT_S)
    assert "test-listener" not in {t.name for t in threading.enumerate()}
    pull.close(linger=0)  # the thread that read it is gone: closing it races nothing
    push.close(linger=0)
    ctx.term()  # every socket closed, the wake pair included: term() would block otherwise


def test_the_lease_worker_runs_jobs_in_order_survives_a_failing_one_and_ends_after_them():
    done: list[int] = []
    release = threading.Event()

    def run(job: int) -> None:
        if job == 0:
            release.wait(WAIT_S)  # hold the worker so the later jobs queue up behind it
        if job == 2:
            raise RuntimeError("a job that fails")
        done.append(job)

    worker = Worker(run, "test-worker")
    worker.start()
    for job in range(5):
        worker.put(job)
    release.set()
    assert worker.stop(WAIT_S)
    assert done == [0, 1, 3, 4]  # every job put before stop ran, in order
    assert "test-worker" not in {t.name for t in threading.enumerate()}


def test_a_worker_never_started_stops_at_once():
    assert Worker(lambda job: None, "never-started").stop(WAIT_S)
