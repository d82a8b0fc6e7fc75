"""The kvsvc.v1.KvTransferService servicer: decode requests, call the node, encode answers."""

from __future__ import annotations

import grpc

from kvsvc.codec import _bad, block_ids_from_proto, layout_from_proto
from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.mapping.planner import Side
from kvsvc.mapping.topology import tp_ratio
from kvsvc.service.errors import rpc_errors
from kvsvc.service.node import Node
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc


def unimplemented(what: str) -> KvsvcError:
    return KvsvcError("NOT_IMPLEMENTED", f"{what} needs the data plane, which this server does not run",
                      code=ErrorCode.UNIMPLEMENTED)


def inline_remote_side(msg: pb.InlineRemote, field: str, local_tp_size: int) -> Side:
    if msg.tp_size == 0:
        raise _bad(f"{field}.tp_size", "must be positive", "MISSING_FIELD")
    tp_ratio(local_tp_size, msg.tp_size)  # TP_NOT_DIVISIBLE before any per-rank head check
    if not msg.HasField("layout"):
        raise _bad(f"{field}.layout", "must be set", "MISSING_FIELD")
    return Side.of(layout_from_proto(msg.layout, f"{field}.layout", msg.tp_size), msg.tp_size)


class KvTransferServicer(pb_grpc.KvTransferServiceServicer):
    """Thin: every rule lives in the node and the layers below it."""

    def __init__(self, node: Node) -> None:
        self.node = node

    @rpc_errors
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        return self.node.info()

    @rpc_errors
    async def PlanTransfer(
        self, request: pb.PlanTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlanTransferResponse:
        which = request.WhichOneof("remote")
        if which == "inline_remote":
            remote = inline_remote_side(request.inline_remote, "inline_remote", self.node.config.tp_size)
        elif which == "remote_address":
            remote = await self.remote_side(request.remote_address)
        else:
            raise _bad("remote", "set inline_remote (layout + tp_size) or remote_address", "MISSING_FIELD")
        ranks = self.node.check_ranks(request.local_ranks, "local_ranks")
        plans = self.node.plan(
            remote, block_ids_from_proto(request.local_block_ids_per_group),
            block_ids_from_proto(request.remote_block_ids_per_group), ranks,
        )
        return self.node.plan_response(plans, request.summary_only)

    async def remote_side(self, address: str) -> Side:
        raise unimplemented("PlanTransfer with remote_address")

    @rpc_errors
    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        raise unimplemented("Handshake")

    @rpc_errors
    async def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishBlocksResponse:
        raise unimplemented("PublishBlocks")

    @rpc_errors
    async def ClaimLease(self, request: pb.ClaimLeaseRequest, context: grpc.aio.ServicerContext) -> pb.ClaimLeaseResponse:
        raise unimplemented("ClaimLease")

    @rpc_errors
    async def Transfer(self, request: pb.TransferRequest, context: grpc.aio.ServicerContext) -> pb.TransferResponse:
        raise unimplemented("Transfer")

    @rpc_errors
    async def Notify(self, request: pb.NotifyRequest, context: grpc.aio.ServicerContext) -> pb.NotifyResponse:
        raise unimplemented("Notify")
