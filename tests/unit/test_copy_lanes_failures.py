"""Copy lanes' failure paths with fake threads and agents (the real transfers are in
tests/e2e/test_copy_lanes.py): a part that cannot be posted, a lane that cannot connect,
a peer forgotten on every lane, and a split READ counted once in the answer."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from kvsvc.transport.copy_lanes import LANE_READ_MIN_BYTES, CopyLanes, LaneAgent
from kvsvc.transport.ports import Flight, TransferError


class Pool:
    memory_kind, device_id = "DRAM", 0


class FakeThread:
    """A lane's thread whose posts succeed or raise, and which settles what it is told to abort."""

    alive = True

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.aborted: list[Flight] = []
        self.posted: list[Flight] = []

    async def post(self, agent: Any, make: Any, inline: bool = False) -> Flight:
        if self.fail:
            raise TransferError("NIXL refused the post")
        loop = asyncio.get_running_loop()
        fl = Flight(agent, None, loop, loop.create_future(), asyncio.Event())
        self.posted.append(fl)
        return fl

    async def abort(self, flights: list[Flight]) -> None:
        for fl in flights:
            if fl in self.posted and not fl.settled.is_set():
                self.aborted.append(fl)
                fl.result.set_exception(TransferError("transfer cancelled"))
                fl.settled.set()


async def test_a_part_that_cannot_be_posted_cancels_and_settles_the_others_first() -> None:
    lanes = CopyLanes(0, lambda rank, lane: f"x/r{rank}/c{lane}")
    good, bad, good2 = FakeThread(False), FakeThread(True), FakeThread(False)
    lanes._threads = [good, bad, good2]  # type: ignore[list-item]
    lanes._agents = [{0: LaneAgent(object(), None, Pool())} for _ in range(3)]  # type: ignore[arg-type]
    lanes._remotes.add((0, "peer"))
    n = 3 * LANE_READ_MIN_BYTES
    assert lanes.takes(0, "peer", n) and not lanes.takes(0, "peer", LANE_READ_MIN_BYTES - 1)
    assert not lanes.takes(0, "other-peer", n) and not lanes.takes(1, "peer", n)
    with pytest.raises(TransferError):
        await lanes.post(0, "peer", np.array([0]), np.array([1 << 30]), np.array([n]), "DRAM", 0)
    posted = good.posted + good2.posted
    assert len(posted) == 2, "the two lanes that could post did"
    assert all(fl.settled.is_set() for fl in posted), "post() raised with READs still running"
    assert sorted(map(id, good.aborted + good2.aborted)) == sorted(map(id, posted))


def test_transfer_response_counts_a_split_read_once() -> None:
    from kvsvc.service.transfer_run import _parts

    loop = asyncio.new_event_loop()
    try:
        flights = [Flight(None, None, loop, loop.create_future(), asyncio.Event()) for _ in range(3)]
        parts = _parts(1, flights, np.array([5, 7, 9]))
        assert [(x.nbytes, x.descriptors) for x in parts] == [(21, 3), (0, 0), (0, 0)]
        assert [x.flight for x in parts] == flights and {x.rank for x in parts} == {1}
    finally:
        loop.close()



class FakeAgent:
    """Records the remotes NIXL would hold; refuses to connect when told to."""

    def __init__(self, refuse: bool = False) -> None:
        self.remotes: set[str] = set()
        self.refuse = refuse

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.remotes.add(metadata.decode())
        return metadata

    def make_connection(self, name: str) -> None:
        if self.refuse:
            raise RuntimeError("UCX: no route")

    def remove_remote_agent(self, name: str) -> None:
        self.remotes.remove(name)


class CallThread:
    alive = True

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


async def test_lanes_connect_and_forget_remotes_on_every_lane_and_undo_a_failed_connect() -> None:
    lanes = CopyLanes(0, lambda rank, lane: f"x/r{rank}/c{lane}")
    agents = [FakeAgent(), FakeAgent()]
    lanes._threads = [CallThread(), CallThread()]  # type: ignore[list-item]
    lanes._agents = [{0: LaneAgent(a, None, Pool())} for a in agents]  # type: ignore[arg-type]
    await lanes.connect(0, b"p/1/r0", "p/1/r0")
    assert lanes.takes(0, "p/1/r0", LANE_READ_MIN_BYTES) and all(a.remotes == {"p/1/r0"} for a in agents)
    await lanes.forget({"p/1/r0"})  # P restarted
    assert not lanes.takes(0, "p/1/r0", LANE_READ_MIN_BYTES) and all(a.remotes == set() for a in agents)
    agents[1].refuse = True  # the second lane cannot reach the new P: no lane reads from it
    await lanes.connect(0, b"p/2/r0", "p/2/r0")
    assert not lanes.takes(0, "p/2/r0", LANE_READ_MIN_BYTES) and all(a.remotes == set() for a in agents)


async def test_no_lanes_start_where_no_pool_is_in_dram() -> None:
    class Vram:
        memory_kind, device_id = "VRAM", 0

    lanes = CopyLanes(2, lambda rank, lane: f"x/r{rank}/c{lane}")
    await lanes.start(api=None, pools={0: Vram(), 1: Vram()}, backends=["UCX"])  # type: ignore[dict-item]
    assert lanes.count == 0 and not lanes.takes(0, "peer", 1 << 30)
    await lanes.close()
