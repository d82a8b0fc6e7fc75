"""TransferStreamSession's bound on what a caller that sends but does not read can make it
hold (a unit test with a fake decoder: gRPC's own buffers hold several MB of answers
before the write the session waits on blocks, too much to flood in a test)."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.errors import ErrorCode, InvalidArgument, KvsvcError
from kvsvc.service import transfer_stream as ts
from kvsvc.v1 import kv_transfer_pb2 as pb


class RefusingDecoder:
    """Every transfer is refused at once: each call becomes an error answer."""

    def __init__(self) -> None:
        self.joined = 0

    def join(self, req, time_remaining_s, trace_ctx=None):
        self.joined += 1
        raise InvalidArgument("MISSING_FIELD", "request_id: must be set", {})


async def test_a_caller_that_does_not_read_has_its_stream_ended(monkeypatch):
    monkeypatch.setattr(ts, "MAX_UNREAD_ANSWERS", 3000)
    decoder = RefusingDecoder()
    session = ts.TransferStreamSession(decoder, None)  # type: ignore[arg-type]
    sent = asyncio.Event()

    async def requests():
        for _ in range(20):  # 20,480 calls, far past the bound
            yield pb.TransferStreamRequest(transfers=[pb.TransferCall()] * 1024)
            await asyncio.sleep(0)
        sent.set()
        await asyncio.Event().wait()  # the caller keeps the stream open

    answers = session.answers(requests())
    first = await answers.__anext__()  # one message taken, then the caller stops reading
    assert len(first.answers) == 1024
    for _ in range(200):
        await asyncio.sleep(0)
    assert session._overflow is not None and len(session._answers) == 0  # dropped, not held
    assert decoder.joined < 3000 + 2 * 1024  # it stopped taking calls at the bound
    with pytest.raises(KvsvcError) as e:
        await answers.__anext__()  # the caller moves again: the stream ends
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "ANSWERS_UNREAD")
    assert not sent.is_set()
