"""The multiplexer both stream channels run on, over fake carriers (the real ones run in
tests/e2e/test_transfer_stream.py, test_transfer_socket.py, test_lease_socket.py and
tests/service/test_lease_channel.py): answers find their callers by key in any order, a
caller that gave up loses nothing to a late answer, an end fails every waiting call once
and admits none after, and the socket sends a loop turn's calls as one message."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.client.multiplex import Multiplexer, StreamEnded, StreamKind
from kvsvc.client.socket_call import SocketCall
from kvsvc.errors import InvalidArgument, KvsvcError, Unreachable
from kvsvc.reasons import Reason


def _answers(resp: dict) -> list[tuple[str, object]]:
    return list(resp.get("answers", []))


KIND: StreamKind[str, str, object] = StreamKind(
    "the test stream", lambda items: list(items), _answers, lambda resp: resp.get("end"),  # type: ignore[arg-type,return-value]
    status_after_failed_write=False)


class FakeGrpcCall:
    """A bidirectional call: writes recorded, responses fed by the test."""

    def __init__(self) -> None:
        self.written: list[list[str]] = []
        self.responses: asyncio.Queue[dict | None] = asyncio.Queue()
        self.cancelled = False
        self.fail_writes = False

    async def write(self, msg: list[str]) -> None:
        if self.fail_writes:
            raise ConnectionResetError("broken")
        self.written.append(msg)
        await asyncio.sleep(0)

    def __aiter__(self) -> FakeGrpcCall:
        return self

    async def __anext__(self) -> dict:
        resp = await self.responses.get()
        if resp is None:
            raise StopAsyncIteration
        return resp

    def cancel(self) -> None:
        self.cancelled = True


async def test_answers_find_their_callers_in_any_order():
    call = FakeGrpcCall()
    mux = Multiplexer(call, KIND, batch=8)
    a, b = mux.expect("a"), mux.expect("b")
    await mux.send("a")
    await mux.send("b")
    call.responses.put_nowait({"answers": [("b", "B"), ("a", InvalidArgument(Reason.INVALID_FIELD, "bad a"))]})
    assert await b == "B"
    with pytest.raises(InvalidArgument):
        await a
    assert call.written == [["a"], ["b"]]
    assert mux.pending == {}
    await mux.close()


async def test_a_caller_that_gave_up_loses_nothing_to_a_late_answer():
    call = FakeGrpcCall()
    mux = Multiplexer(call, KIND, batch=8)
    gone = mux.expect("x")
    mux.forget("x", gone)
    kept = mux.expect("y")
    await mux.send("y")
    call.responses.put_nowait({"answers": [("x", "late"), ("y", "Y")]})
    assert await kept == "Y"
    assert not gone.done()  # nobody set it: its caller is gone
    await mux.close()


async def test_an_end_fails_every_waiting_call_once_and_admits_none_after():
    call = FakeGrpcCall()
    mux = Multiplexer(call, KIND, batch=8)
    waiting = [mux.expect(k) for k in ("a", "b")]
    await mux.send("a")
    why = KvsvcError(Reason.SHUTTING_DOWN, "draining")
    call.responses.put_nowait({"end": why})
    for fut in waiting:
        with pytest.raises(StreamEnded) as e:
            await fut
        assert e.value.error is why
    assert mux.ended and call.cancelled
    with pytest.raises(StreamEnded):
        mux.expect("c")
    with pytest.raises(StreamEnded):
        await mux.send("c")
    await mux.close()


async def test_a_failed_write_ends_the_stream_as_broken():
    call = FakeGrpcCall()
    call.fail_writes = True
    mux = Multiplexer(call, KIND, batch=8)
    fut = mux.expect("a")
    await mux.send("a")
    with pytest.raises(StreamEnded) as e:
        await fut
    assert isinstance(e.value.error, Unreachable)
    await mux.close()


async def test_a_stream_the_reader_sees_close_ends_with_no_error():
    call = FakeGrpcCall()
    mux = Multiplexer(call, KIND, batch=8)
    fut = mux.expect("a")
    call.responses.put_nowait(None)  # the server closed the stream cleanly
    with pytest.raises(StreamEnded) as e:
        await fut
    assert e.value.error is None


class FakeSocket(SocketCall):
    """A SocketCall whose messages are recorded instead of framed onto a transport."""

    def __init__(self) -> None:
        super().__init__(1 << 20, lambda b: b, "the test socket")
        self.sent: list[list[str]] = []

    def write_now(self, msg) -> None:  # type: ignore[override]
        self.sent.append(msg)

    def check_reading(self) -> None:
        pass

    def cancel(self) -> None:
        pass


async def test_the_socket_sends_a_loop_turns_calls_as_one_message_in_batches():
    sock = FakeSocket()
    mux = Multiplexer(sock, KIND, batch=2)
    futs = [mux.expect(k) for k in "abcde"]
    for k in "abcde":
        await mux.send(k)
    assert sock.sent == []  # nothing until the end of this loop turn
    await asyncio.sleep(0)
    assert sock.sent == [["a", "b"], ["c", "d"], ["e"]]
    mux._deliver({"answers": [(k, k.upper()) for k in "edcba"]})  # as the socket hands a message over
    assert [await f for f in futs] == list("ABCDE")
    await mux.close()


class HeldWriteCall(FakeGrpcCall):
    """A gRPC call whose writes wait for the test to let them through (one event each)."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()
        self.go = asyncio.Event()

    async def write(self, msg: list[str]) -> None:
        self.writing.set()
        await self.go.wait()
        self.written.append(msg)


async def test_a_caller_cancelled_mid_write_ends_only_its_own_wait():
    """The caller whose task writes a message carrying a bystander's call is cancelled while
    the write is in flight: the write completes, the stream stays open, the bystander is
    answered (a cut write used to end the stream for every call on it)."""
    call = HeldWriteCall()
    mux = Multiplexer(call, KIND, batch=8)
    mine, theirs = mux.expect("mine"), mux.expect("theirs")
    writer = asyncio.ensure_future(mux.send("mine"))
    await call.writing.wait()
    await mux.send("theirs")  # queued behind the write in flight
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writer
    mux.forget("mine", mine)
    call.go.set()
    call.responses.put_nowait({"answers": [("theirs", "T")]})
    assert await asyncio.wait_for(theirs, 10) == "T"
    assert not mux.ended and call.written == [["mine"], ["theirs"]]
    await mux.close()


async def test_a_call_is_unwritten_until_its_message_is_out():
    call = HeldWriteCall()
    mux = Multiplexer(call, KIND, batch=8)
    mux.expect("a")
    first = mux.queued
    writer = asyncio.ensure_future(mux.send("a"))
    await call.writing.wait()
    second = mux.queued
    await mux.send("b")  # behind the write in flight
    assert mux.unwritten(first) and mux.unwritten(second)
    call.go.set()
    await writer  # returns once the writer wrote everything queued
    assert not mux.unwritten(first) and not mux.unwritten(second)
    await mux.close()


class Sized(str):
    """A queued call of a given byte size (as a protobuf's ByteSize)."""

    def __new__(cls, key: str, size: int) -> Sized:
        item = super().__new__(cls, key)
        item.size = size  # type: ignore[attr-defined]
        return item


async def test_messages_are_bounded_in_bytes_and_a_call_too_large_fails_alone(monkeypatch):
    from kvsvc.client import multiplex

    monkeypatch.setattr(multiplex, "_size", lambda item: item.size)
    kind: StreamKind[str, str, object] = StreamKind(
        "the test stream", lambda items: [str(i) for i in items], _answers,  # type: ignore[arg-type,return-value]
        lambda resp: resp.get("end"), status_after_failed_write=False, key=lambda item: str(item))
    sock = FakeSocket()
    mux = Multiplexer(sock, kind, batch=100, max_bytes=multiplex.MESSAGE_MARGIN_BYTES + 4096)
    items = [Sized("a", 1500), Sized("b", 1500), Sized("huge", 10_000), Sized("c", 1500), Sized("d", 100)]
    futs = {str(i): mux.expect(str(i)) for i in items}
    for item in items:
        await mux.send(item)
    await asyncio.sleep(0)
    assert sock.sent == [["a", "b"], ["c", "d"]]  # at most 4096 bytes a message, in order
    with pytest.raises(KvsvcError) as e:
        await futs["huge"]
    assert e.value.reason == "FIELD_TOO_LARGE" and int(e.value.metadata["limit"]) == 4096
    assert not mux.ended and not mux.unwritten(len(items) - 1)
    await mux.close()
