"""Short READs posted from the event loop (NixlThread.post(..., inline=True)).

A fake agent stands in for NIXL here (the e2e suites post real READs both ways: 1-block
transfers inline, 64 MiB ones on the thread). What is checked: an inline post makes its
NIXL calls on the loop's thread and resolves without the NIXL thread; while the NIXL
thread holds NIXL the post queues instead of waiting; a READ still running after an
inline post is polled to its end by the thread; NIXL's errors come back as
TransferError with the handle freed; no post is accepted once the thread is stopping.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsvc.transport.nixl_thread import NixlThread, TransferError


class FakeAgent:
    """Records which thread made each NIXL call; READs finish after `polls_to_finish` polls."""

    def __init__(self, first_state: str = "DONE", polls_to_finish: int = 0, raise_on_transfer: bool = False) -> None:
        self.first_state, self.polls_left, self.raise_on_transfer = first_state, polls_to_finish, raise_on_transfer
        self.calls: list[tuple[str, int]] = []
        self.released: list[object] = []

    def _note(self, what: str) -> None:
        self.calls.append((what, threading.get_ident()))

    def make(self) -> object:
        self._note("make")
        return object()

    def transfer(self, handle: object) -> str:
        self._note("transfer")
        if self.raise_on_transfer:
            raise RuntimeError("nixlBackendError")
        return self.first_state

    def check_xfer_state(self, handle: object) -> str:
        self._note("check")
        if self.first_state != "PROC":
            return self.first_state
        if self.polls_left > 0:
            self.polls_left -= 1
            return "PROC"
        return "DONE"

    def release_xfer_handle(self, handle: object) -> None:
        self._note("release")
        self.released.append(handle)

    def threads(self, what: str) -> set[int]:
        return {t for w, t in self.calls if w == what}


@pytest.fixture
async def nixl_thread():
    t = NixlThread("test-inline")
    t.start()
    try:
        yield t
    finally:
        await asyncio.to_thread(t.stop)


async def test_an_inline_post_is_made_and_settled_on_the_loop(nixl_thread):
    agent = FakeAgent()
    fl = await nixl_thread.post(agent, agent.make, inline=True)
    me = threading.get_ident()
    assert fl.result.done() and fl.settled.is_set()  # no hop: settled before post returned
    assert fl.result.result() >= 0
    assert agent.threads("make") == {me} and agent.threads("transfer") == {me} and agent.threads("release") == {me}
    assert agent.released == [fl.handle]


async def test_a_queued_post_runs_on_the_nixl_thread(nixl_thread):
    agent = FakeAgent()
    fl = await nixl_thread.post(agent, agent.make, inline=False)
    await fl.result
    assert threading.get_ident() not in agent.threads("make")


async def test_the_loop_does_not_wait_while_the_thread_holds_nixl(nixl_thread):
    """A job on the NIXL thread (a slow connect, say) holds NIXL: an inline post then queues,
    the event loop keeps running, and the READ is posted once the job is over."""
    release_job, job_running = threading.Event(), threading.Event()

    def slow_job() -> None:
        job_running.set()
        release_job.wait(5)

    job = asyncio.ensure_future(nixl_thread.call(slow_job))
    await asyncio.to_thread(job_running.wait, 5)
    agent = FakeAgent()
    assert nixl_thread.post_now(agent, agent.make) is None  # NIXL busy: the caller must queue it
    post = asyncio.ensure_future(nixl_thread.post(agent, agent.make, inline=True))
    ticks = 0
    for _ in range(5):  # the loop is free while the post waits for the thread
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and not post.done() and agent.calls == []
    release_job.set()
    fl = await asyncio.wait_for(post, 5)
    await asyncio.wait_for(fl.result, 5)
    await job
    assert threading.get_ident() not in agent.threads("make")  # made on the NIXL thread after all


async def test_a_read_still_running_after_an_inline_post_is_polled_by_the_thread(nixl_thread):
    agent = FakeAgent(first_state="PROC", polls_to_finish=3)
    fl = await nixl_thread.post(agent, agent.make, inline=True)
    assert not fl.result.done()
    await asyncio.wait_for(fl.result, 5)
    await asyncio.wait_for(fl.settled.wait(), 5)
    me = threading.get_ident()
    assert agent.threads("transfer") == {me}
    assert agent.threads("release") and me not in agent.threads("release")  # ended on the thread
    assert agent.released == [fl.handle]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "queued"])
async def test_nixl_errors_free_the_handle(nixl_thread, inline):
    refused = FakeAgent(first_state="ERR")
    fl = await nixl_thread.post(refused, refused.make, inline=inline)
    with pytest.raises(TransferError):
        await fl.result
    assert fl.settled.is_set() or await asyncio.wait_for(fl.settled.wait(), 5)
    assert refused.released == [fl.handle]

    raising = FakeAgent(raise_on_transfer=True)
    with pytest.raises(RuntimeError, match="nixlBackendError"):
        await nixl_thread.post(raising, raising.make, inline=inline)
    assert len(raising.released) == 1  # the handle NIXL would not post was freed


async def test_no_inline_post_once_the_thread_is_stopping():
    t = NixlThread("test-inline-stop")
    t.start()
    agent = FakeAgent()
    await t.call(lambda: None)
    with t._nixl:  # what the thread sets when it takes stop() (set here to catch the window)
        t._stopping = True
    with pytest.raises(TransferError, match="stopping"):
        await t.post(agent, agent.make, inline=True)
    assert agent.calls == []
    await asyncio.to_thread(t.stop)
    with pytest.raises(TransferError, match="not running"):
        await t.post(agent, agent.make, inline=True)


def test_only_short_reads_between_dram_pools_are_posted_inline():
    import numpy as np

    from kvsvc.transport.nixl_agents import INLINE_READ_MAX_BYTES, _inline

    short, long_ = np.array([4096, 4096]), np.array([INLINE_READ_MAX_BYTES, 1])
    assert _inline(short, "DRAM", "DRAM")
    assert _inline(np.array([INLINE_READ_MAX_BYTES]), "DRAM", "DRAM")
    assert not _inline(long_, "DRAM", "DRAM")
    # GPU memory on either side: posted on the NIXL thread, whatever the size.
    assert not _inline(short, "VRAM", "DRAM") and not _inline(short, "DRAM", "VRAM")
