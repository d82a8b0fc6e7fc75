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


def test_a_progressive_p_room_opens_with_the_first_chunks_and_commits_each_later_one_once():
    room = PRoom()
    room.add_chunk(pages(1, 2), None, progressive=True)
    room.add_chunk(pages(3), None, progressive=True)  # the lease worker lagged: both open the lease
    got = room.take_unsent()
    assert got is not None and got[0].tolist() == [1, 2, 3] and got[1:] == (False, True) and room.epoch == 1
    assert room.state is PState.LEASING and room.take_unsent() is None  # nothing more until it is made
    assert room.lease_made()
    assert room.take_unsent() is None  # every chunk is in the lease
    room.add_chunk(pages(4, 5), None, progressive=True)
    got = room.take_unsent()
    assert got is not None and got[0].tolist() == [4, 5] and got[1:] == (False, False) and room.epoch == 2
    room.add_chunk(pages(6), pages(9), progressive=True, last=True)
    got = room.take_unsent()
    assert got is not None and got[0].tolist() == [6] and got[1:] == (True, False) and room.epoch == 3
    assert room.window.tolist() == [9] and room.pages_sent == 6
    assert room.take_unsent() is None  # final: nothing after it
    room.add_chunk(pages(7), None, progressive=True)  # a chunk after the last changes nothing
    assert room.take_unsent() is None and room.pages_sent == 6


def test_a_progressive_p_room_whose_first_chunk_is_the_last_is_leased_whole():
    room = PRoom()
    room.add_chunk(pages(1, 2), None, progressive=True, last=True)
    got = room.take_unsent()
    assert got is not None and got[0].tolist() == [1, 2] and got[1:] == (True, True)  # whole: one lease, final
    assert room.lease_made() and room.take_unsent() is None


def test_an_abort_mid_stream_takes_the_growing_lease_back_and_stops_the_commits():
    room = PRoom()
    room.add_chunk(pages(1), None, progressive=True)
    room.take_unsent()
    room.lease_made()
    assert room.abort() is OnAbort.WITHDRAW and room.state is PState.WITHDRAWING
    room.add_chunk(pages(2), None, progressive=True, last=True)
    assert room.take_unsent() is None  # no commit after the abort


def test_a_refused_commit_stops_the_stream():
    room = PRoom()
    room.add_chunk(pages(1), None, progressive=True)
    room.take_unsent()
    room.lease_made()
    room.add_chunk(pages(2), None, progressive=True)
    assert room.take_unsent() is not None
    room.stop_stream()  # the lease refused that commit (D gave the request up)
    room.add_chunk(pages(3), None, progressive=True, last=True)
    assert room.take_unsent() is None


def test_a_progressive_d_room_waits_for_p_aux_row_after_its_transfer_succeeded():
    class Piece:
        def __init__(self, progressive: bool, aux: list[bytes]) -> None:
            self.params, self.aux = type("P", (), {"progressive": progressive})(), aux

    room = d_room(2)
    room.add_piece(1, Piece(True, []))
    room.add_piece(0, Piece(True, []))
    fut: concurrent.futures.Future[object] = concurrent.futures.Future()
    room.run(fut)
    room.add_aux(1, [b"rank 1"])
    assert room.aux() is None  # the lowest P rank's row is the one written
    fut.set_result(None)
    assert room.loaded() and room.state is DState.LOADED and not room.running
    room.add_aux(0, [b"rank 0"])
    assert room.aux() == [b"rank 0"]
    # SGLang failing a loaded room (its aux row never came) fails it now: nothing writes.
    other = d_room(1)
    other.add_piece(0, Piece(True, []))
    done: concurrent.futures.Future[object] = concurrent.futures.Future()
    done.set_result(None)
    other.run(done)
    assert other.loaded() and other.fail() is False and other.state is DState.FAILED
    # A whole lease's READY carries the row: nothing to wait for.
    whole = d_room(1)
    whole.add_piece(0, Piece(False, [b"row"]))
    whole.run(done)
    assert not whole.loaded() and whole.aux() == [b"row"]
