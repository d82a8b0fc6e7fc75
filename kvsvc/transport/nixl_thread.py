"""The one thread that makes every NIXL call of the process, and the progress pump on it.

NIXL is not thread-safe, and with its own progress thread off (twice the bandwidth on
small machines) someone must drive progress. Both jobs live here: the thread executes
queued calls and, while its own transfers are in flight, polls them with short sleeps
that grow to INFLIGHT_MAX_SLEEP_S; while only peers may be reading (a live lease), it
progresses its agents every PROGRESS_MAX_SLEEP_S. With neither it blocks on its queue,
waking once every IDLE_BEAT_S after peers connected (UCX needs that much, see there).
Results reach asyncio as futures resolved with call_soon_threadsafe; nothing polls on
the event loop.

A short READ is posted from the event loop itself (post_now): a hand-off to
this thread and back costs two wake-ups and more than the post does, and a READ between
processes of one host is often complete when NIXL's transfer() returns. NIXL's agents are
made without locks of their own (one caller at a time), so every NIXL call of the thread
is made holding `_nixl`, and the event loop posts only when it can take that lock at once:
otherwise the READ queues as before, and the loop never waits for the thread. A READ that
is still running after its inline post is handed to this thread to be polled.

The thread waits for work with select() on a pipe that every submission writes a byte
to, never with queue.SimpleQueue.get(timeout=...): on this machine (CPython 3.11) a get
with a timeout of tens of microseconds was seen to block for seconds with the queue empty
and the timeout long past, about once in a thousand transfers, stalling every READ in
flight until its deadline. A kernel timeout on a file descriptor has no such failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvsvc.loops import tell
from kvsvc.transport.ports import Flight, TransferError

log = logging.getLogger(__name__)

T = TypeVar("T")

PROGRESS_MIN_SLEEP_S = 20e-6
PROGRESS_MAX_SLEEP_S = 1e-3
INFLIGHT_MAX_SLEEP_S = 200e-6
"""With READs in flight the pump sleeps at most this long: UCX moves shared-memory bytes
inside the progress call, so a long sleep is time the copy stands still."""
IDLE_BEAT_S = 1.0
"""Once peers have connected, agents are progressed at least this often even with nothing
to do: a UCX target that never progresses stalls its readers' next READ after some 20 s
(measured here); a beat a second keeps the endpoints answering at no measurable CPU."""
_STOP = object()




def _fail_future(fut: asyncio.Future[Any], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


class NixlThread:
    """Owner of the NIXL thread. start() once; stop() ends it after in-flight work settles."""

    def __init__(self, name: str = "kvsvc-nixl") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Wakes the thread: a byte per submission (see the module docstring).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_closed = False
        self._inflight: list[Flight] = []
        self._progress_agents: list[Any] = []
        self._progress_refs = 0
        self._beat = False
        self._next_beat = 0.0  # monotonic time the beat is next due
        self._notif_sink: Callable[[Any, dict[str, list[bytes]]], None] | None = None
        # Held for every NIXL call: by this thread while it works, by the event loop for an
        # inline post (taken without waiting, see the module docstring).
        self._nixl = threading.Lock()
        self._stopping = False  # set, holding _nixl, once the thread drains for stop()
        self._thread = threading.Thread(target=self._run_main, name=name, daemon=True)
        self._started = False
        # True from start() until the thread's main function returns or raises: what
        # `alive` reads, twice per transfer (Thread.is_alive takes a lock each time).
        self._running = False
        self.on_dead: Callable[[], object] | None = None

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._running = True
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._started and self._thread.is_alive():
            self._submit(_STOP)
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and not self._wake_closed:
            self._wake_closed = True  # before closing: a late _submit must not write to a reused fd
            os.close(self._wake_r)
            os.close(self._wake_w)

    @property
    def alive(self) -> bool:
        """Started and still running (False after stop() or a crash)."""
        return self._running

    # ---- asyncio side ---------------------------------------------------------------

    def _submit(self, job: Any) -> None:
        """Queue a job and wake the thread (any thread may call this)."""
        self._jobs.put(job)
        if self._wake_closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will look at the queue
        except OSError:
            pass  # closed: the thread has ended (callers check alive first)

    def _check_alive(self) -> None:
        if self._started and not self._running:
            raise TransferError("the NIXL thread is not running")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the NIXL thread and await its result (or exception)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submit((fn, args, fut, loop))
        return await fut

    def post_now(self, agent: Any, make_handle: Callable[[], Any]) -> Flight | None:
        """Create and post a transfer from the calling (event loop) thread, if NIXL is free at
        once; None if the NIXL thread holds it (post() then). For short READs only: a READ
        between processes of one host copies inside the post."""
        self._check_alive()
        if not self._nixl.acquire(blocking=False):
            return None
        loop = asyncio.get_running_loop()
        fl = Flight(agent, None, loop, loop.create_future(), asyncio.Event())
        try:
            if self._stopping:  # nobody would poll it: refuse, as a dead thread does
                raise TransferError("the NIXL thread is stopping")
            done, error = self._start(fl, make_handle)
            if done:
                self._end(fl)
        finally:
            self._nixl.release()
        if done:
            if error is None:
                fl.result.set_result(fl.elapsed)
            else:
                fl.result.set_exception(error)
            fl.settled.set()
        else:
            self._submit((self._track, (fl,), None, None))  # still running: polled by the thread
        return fl

    async def post(self, agent: Any, make_handle: Callable[[], Any], inline: bool = False) -> Flight:
        """Create and post a transfer (inline: from this thread when NIXL is free, see
        post_now; else on the NIXL thread); the returned Flight resolves later."""
        if inline:
            fl = self.post_now(agent, make_handle)
            if fl is not None:
                return fl
        self._check_alive()
        loop = asyncio.get_running_loop()
        fl = Flight(agent, None, loop, loop.create_future(), asyncio.Event())
        posted: asyncio.Future[Flight] = loop.create_future()
        self._submit((self._post, (fl, make_handle), posted, loop))
        return await posted

    async def abort(self, flights: list[Flight]) -> None:
        """Give up waiting for these transfers' results: each fails now ("transfer
        cancelled"), but settles only when NIXL says it ended (DONE or ERR).

        Never by releasing an active handle: NIXL's UCX backend accepts that and deletes its
        requests, but UCX cannot recall a READ it issued -- between hosts over TCP the reply
        of a READ cut off by a link failure arrived seconds after the link came back and was
        written into D's blocks, after the transfer had been called settled and its blocks
        were in use again (tests/hosts/test_across_hosts.py, one run in four).
        """
        await self.call(self._abort, flights)

    def set_progress(self, agents: list[Any], notif_sink: Callable[[Any, dict[str, list[bytes]]], None]) -> None:
        """Agents that peers read from: progressed (and their notifications drained) while needed."""
        self._submit((self._set_progress, (agents, notif_sink), None, None))

    def need_progress(self, delta: int) -> None:
        """+1 while a peer may be reading (a live lease, a handshake), -1 when that ends."""
        self._submit((self._adjust_progress, (delta,), None, None))

    def beat_when_idle(self) -> None:
        """From now on progress the agents every IDLE_BEAT_S even with nothing to do."""
        if not self._beat:
            self._submit((self._start_beat, (), None, None))

    # ---- NIXL thread side -----------------------------------------------------------

    def _set_progress(self, agents: list[Any], sink: Callable[[Any, dict[str, list[bytes]]], None]) -> None:
        self._progress_agents, self._notif_sink = list(agents), sink

    def _start_beat(self) -> None:
        self._beat = True

    def _adjust_progress(self, delta: int) -> None:
        self._progress_refs = max(0, self._progress_refs + delta)

    @staticmethod
    def _start(fl: Flight, make_handle: Callable[[], Any]) -> tuple[bool, Exception | None]:
        """Make and post the transfer (NIXL held by the caller): (over, its error)."""
        fl.handle = make_handle()
        fl.posted_at = time.perf_counter()
        try:
            state = fl.agent.transfer(fl.handle)
            if state == "PROC":  # progress it once at once: a small READ is often done by then
                state = fl.agent.check_xfer_state(fl.handle)
        except Exception:  # NIXL refused the post by raising: the handle is ours to free
            try:
                fl.agent.release_xfer_handle(fl.handle)
            except Exception:
                log.debug("release_xfer_handle failed", exc_info=True)
            raise
        if state == "ERR":
            return True, TransferError("NIXL refused to post the transfer")
        return state == "DONE", None

    def _post(self, fl: Flight, make_handle: Callable[[], Any]) -> Flight:
        over, error = self._start(fl, make_handle)
        if over:
            self._finish(fl, error)
        else:
            self._inflight.append(fl)
        return fl

    def _track(self, fl: Flight) -> None:
        self._inflight.append(fl)

    def _abort(self, flights: list[Flight]) -> None:
        wanted = {id(f) for f in flights}
        for fl in self._inflight:
            if id(fl) in wanted:
                tell(fl.loop, _fail_future, fl.result, TransferError("transfer cancelled"))

    @staticmethod
    def _end(fl: Flight) -> None:
        """Time the transfer and let go of its handle (NIXL held by the caller)."""
        fl.elapsed = time.perf_counter() - fl.posted_at
        try:
            fl.agent.release_xfer_handle(fl.handle)
        except Exception:  # releasing a failed handle may fail too; the transfer is over either way
            log.debug("release_xfer_handle failed", exc_info=True)

    def _finish(self, fl: Flight, error: Exception | None) -> None:
        self._end(fl)

        def resolve() -> None:
            if not fl.result.done():
                if error is None:
                    fl.result.set_result(fl.elapsed)
                else:
                    fl.result.set_exception(error)
            fl.settled.set()

        tell(fl.loop, resolve)

    def _poll(self) -> bool:
        """Advance every in-flight transfer once; True when something completed."""
        progressed = False
        still: list[Flight] = []
        for fl in self._inflight:
            err: Exception | None = None
            try:
                state = fl.agent.check_xfer_state(fl.handle)
            except Exception as e:
                state, err = "ERR", e
            if state == "PROC":
                still.append(fl)
                continue
            progressed = True
            self._finish(fl, None if state == "DONE" else TransferError(f"transfer failed: {err or state}"))
        self._inflight = still
        now = time.monotonic()
        if self._progress_agents and (self._progress_refs or (self._beat and now >= self._next_beat)):
            self._next_beat = now + IDLE_BEAT_S  # the beat only where nothing else progressed them
            for agent in self._progress_agents:
                try:
                    notifs = agent.get_new_notifs()
                except Exception:
                    log.warning("progressing a NIXL agent failed", exc_info=True)
                    continue
                if notifs and self._notif_sink is not None:
                    self._notif_sink(agent, notifs)
        return progressed

    def _run_job(self, job: Any) -> None:
        fn, args, fut, loop = job
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        if fut is None:
            if error is not None:
                log.error("NIXL job %s failed: %s", getattr(fn, "__name__", fn), error)
            return

        def resolve() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        tell(loop, resolve)

    def _run_main(self) -> None:
        stopped = False
        try:
            self._main()
            stopped = True
        except BaseException:
            log.critical("the NIXL thread crashed", exc_info=True)
        finally:
            self._running = False
            if not stopped:
                self._fail_pending()
                if self.on_dead is not None:
                    self.on_dead()

    def _fail_pending(self) -> None:
        """After a crash: fail queued calls and in-flight transfers instead of leaving them hanging."""
        dead = TransferError("the NIXL thread stopped")
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                continue
            _fn, _args, fut, loop = job
            if fut is not None:
                tell(loop, _fail_future, fut, dead)
        for fl in self._inflight:
            # The result fails, but `settled` stays unset: a READ NIXL was running may still
            # land (an RDMA NIC does not need this thread), so its blocks are never called free.
            tell(fl.loop, _fail_future, fl.result, dead)
        self._inflight = []

    def _main(self) -> None:
        sleep = PROGRESS_MIN_SLEEP_S
        while True:
            if self._inflight:  # our own READs: short sleeps, the copy moves inside progress calls
                timeout: float | None = sleep
            elif self._progress_refs > 0 and self._progress_agents:
                # Only peers' READs, which complete without us (they carry no notification):
                # progress keeps UCX's endpoints healthy, and a slow beat does that.
                timeout = PROGRESS_MAX_SLEEP_S
            else:
                timeout = max(0.0, self._next_beat - time.monotonic()) if self._beat and self._progress_agents else None
            job = self._next_job(timeout)
            with self._nixl:  # not while waiting above: the event loop may post meanwhile
                if job is _STOP:
                    self._stopping = True
                    self._drain_for_stop()
                    return
                if job is not None:
                    self._run_job(job)
                    sleep = PROGRESS_MIN_SLEEP_S
                if self._poll():
                    sleep = PROGRESS_MIN_SLEEP_S
                elif job is None:
                    sleep = min(sleep * 2, INFLIGHT_MAX_SLEEP_S)

    def _next_job(self, timeout_s: float | None) -> Any:
        """The next queued job, waiting up to timeout_s (None: until one comes); None if none came.

        No wake-up is lost: a submitter queues before it writes, and this reads the queue
        again after draining the pipe (a byte left over only causes one spurious wake-up).
        """
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            pass
        select.select([self._wake_r], [], [], timeout_s)
        try:
            os.read(self._wake_r, 65536)
        except BlockingIOError:
            pass
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            return None

    def _drain_for_stop(self, timeout_s: float = 5.0) -> None:
        end = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < end:
            self._poll()
            time.sleep(PROGRESS_MIN_SLEEP_S)
        for fl in self._inflight:
            self._finish(fl, TransferError("server stopped before the transfer completed"))
        self._inflight = []
