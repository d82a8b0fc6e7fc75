"""A TransferStream the server refused at once: the caller gets the server's reason even
when the refusal reaches it through a failed write first (gRPC's own error for writing
into an ended call carries no reason: round three, 11)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_status import rpc_status

from kvsvc.client.multiplex import StreamEnded
from kvsvc.client.transfer_stream import transfer_stream
from kvsvc.errors import PermissionDenied
from kvsvc.service.errors import to_status
from kvsvc.v1 import kv_transfer_pb2 as pb


def _rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


class RefusedCall:
    """A call whose write fails first (gRPC's INTERNAL for a batch on an ended call) and
    whose read brings the server's PERMISSION_DENIED / NOT_AN_ENGINE a moment later."""

    def __init__(self) -> None:
        status = rpc_status.to_status(to_status(PermissionDenied("NOT_AN_ENGINE", "only this server's engine")))
        self._refusal = _rpc_error(grpc.StatusCode.PERMISSION_DENIED, status.details, status.trailing_metadata)

    async def write(self, msg: pb.TransferStreamRequest) -> None:
        raise _rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")

    def __aiter__(self) -> RefusedCall:
        return self

    async def __anext__(self) -> pb.TransferStreamResponse:
        await asyncio.sleep(0.05)
        raise self._refusal

    def cancel(self) -> None:
        pass


async def test_a_refusal_that_fails_the_write_first_still_says_why():
    stream = transfer_stream(RefusedCall())
    fut = stream.expect("r")
    await stream.send(pb.TransferCall(request=pb.TransferRequest(request_id="r")))
    with pytest.raises(StreamEnded) as e:
        await fut
    assert e.value.error is not None and e.value.error.reason == "NOT_AN_ENGINE"
