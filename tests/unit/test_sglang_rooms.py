"""SGLang's backend's per-request state machines (integrations/sglang/rooms.py), every
transition and every race the manager's lock decides: an abort before, during and after the
lease; SGLang failing a D room before, while and after its transfer runs."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from kvsvc.integrations.sglang.rooms import DRoom, DState, OnAbort, PRoom, PRooms, PState


def pages(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def test_a_p_room_leases_every_chunk_once():
    room = PRoom()
    room.add_chunk(pages(3, 4), None)
    room.add_chunk(pages(5), pages(9))
    leased = room.start_lease()
    assert leased is not None and leased.tolist() == [3, 4, 5] and room.window.tolist() == [9]
    assert room.state is PState.LEASING and room.leased
    assert room.start_lease() is None  # the last chunk twice: one lease
    room.add_chunk(pages(6), None)  # a chunk after the lease started changes nothing
    assert room.lease_made() and room.state is PState.LEASED
    assert room.pages[-1].tolist() == [5]


@pytest.mark.parametrize("when,then,state", [
    ("open", OnAbort.FAIL, PState.ABORTED),  # nothing leased: fail now
    ("leasing", OnAbort.LEASE_WORKER, PState.WITHDRAWING),  # the worker takes it back once made
    ("leased", OnAbort.WITHDRAW, PState.WITHDRAWING),  # take it back now
    ("refused", OnAbort.FAIL, PState.ABORTED),
])
def test_an_abort_at_each_point_of_p(when, then, state):
    room = PRoom()
    if when != "open":
        room.start_lease()
    if when == "leased":
        room.lease_made()
    if when == "refused":
        room.lease_refused()
        assert room.state is PState.FAILED and not room.leased
    assert room.abort() is then
    assert room.state is state and room.aborted and not room.leased
    assert room.abort() is OnAbort.NOTHING  # a second abort (P's and D's notice) does nothing


def test_a_lease_made_after_an_abort_is_taken_back_not_told():
    room = PRoom()
    room.start_lease()
    assert room.abort() is OnAbort.LEASE_WORKER
    assert not room.lease_made() and room.state is PState.WITHDRAWING
    assert room.start_lease() is None  # and never leased again


def test_p_rooms_are_bounded_and_remember_why_cleared_ones_failed():
    evicted: list[int] = []
    rooms = PRooms(3, evicted.append)
    for room_id in range(5):
        rooms.get_or_make(room_id)
    assert evicted == [0, 1] and len(rooms) == 3 and rooms.get(0) is None
    assert rooms.get_or_make(4) is rooms.get(4)
    assert rooms.clear(4, "aborted") is not None and rooms.ended(4) == "aborted"
    assert rooms.clear(3, None) is not None and rooms.ended(3) is None  # succeeded: nothing to answer
    for room_id in range(10, 14):
        rooms.clear(room_id, "gone")
    assert rooms.ended(4) is None and rooms.ended(13) == "gone"  # the oldest failures go first


def d_room(expected: int = 2) -> DRoom:
    return DRoom(pages(1, 2), 0, expected)


def test_a_d_room_starts_once_every_p_rank_answered():
    room = d_room()
    assert room.add_piece(0, "p0") is None
    assert room.add_piece(0, "p0 again") is None  # a duplicate counts once
    assert room.add_piece(1, "p1") == ["p0 again", "p1"]
    fut: concurrent.futures.Future[object] = concurrent.futures.Future()
    room.run(fut)
    assert room.state is DState.RUNNING and room.running
    assert room.add_piece(1, "late") is None  # a READY after the start starts nothing
    fut.set_result(None)
    assert not room.running


def test_sglang_failing_a_d_room_before_its_transfer_starts_stops_it_starting():
    room = d_room(1)
    assert room.fail() is False  # fail now: nothing writes
    assert room.state is DState.FAILED
    assert room.add_piece(0, "p0") is None  # the READY that comes later starts nothing


def test_sglang_failing_a_running_d_room_waits_for_the_transfer_to_settle():
    room = d_room(1)
    room.add_piece(0, "p0")
    fut: concurrent.futures.Future[object] = concurrent.futures.Future()
    room.run(fut)
    assert room.fail() is True and room.state is DState.FAILING  # cancel it, fail once settled
    assert room.fail() is True  # still writing: still wait
    fut.set_result(None)
    assert room.fail() is False and room.state is DState.FAILING  # settled: fail now, never Success


def test_sglang_failing_a_d_room_whose_transfer_settled_fails_it_now():
    room = d_room(1)
    room.add_piece(0, "p0")
    fut: concurrent.futures.Future[object] = concurrent.futures.Future()
    fut.set_result(None)
    room.run(fut)
    assert room.fail() is False and room.state is DState.FAILING
