"""The kvsvc.v1.KvTransferService servicer: decode requests, call the node, encode answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_status import rpc_status

from kvsvc.codec import bad_field, block_ids_from_proto, layout_from_proto
from kvsvc.config import Role
from kvsvc.errors import KvsvcError
from kvsvc.mapping.planner import Side
from kvsvc.mapping.topology import tp_ratio
from kvsvc.service import prefill
from kvsvc.service.decode import Decoder
from kvsvc.service.errors import rpc_errors, to_status
from kvsvc.service.node import Node
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc


def inline_remote_side(msg: pb.InlineRemote, field: str, local_tp_size: int) -> Side:
    if msg.tp_size == 0:
        raise bad_field(f"{field}.tp_size", "must be positive", "MISSING_FIELD")
    tp_ratio(local_tp_size, msg.tp_size)  # TP_NOT_DIVISIBLE before any per-rank head check
    if not msg.HasField("layout"):
        raise bad_field(f"{field}.layout", "must be set", "MISSING_FIELD")
    return Side.of(layout_from_proto(msg.layout, f"{field}.layout", msg.tp_size), msg.tp_size)


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """Names in the caller's TLS certificate (common name and DNS names); empty without mTLS."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


class KvTransferServicer(pb_grpc.KvTransferServiceServicer):
    """Thin: every rule lives in the node, the role modules and the layers below them."""

    def __init__(self, node: Node, decoder: Decoder) -> None:
        self.node = node
        self.decoder = decoder

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
            remote = await self.decoder.peers.side_of(request.remote_address)
        else:
            raise bad_field("remote", "set inline_remote (layout + tp_size) or remote_address", "MISSING_FIELD")
        ranks = self.node.check_ranks(request.local_ranks, "local_ranks")
        plans = self.node.plan(
            remote, block_ids_from_proto(request.local_block_ids_per_group),
            block_ids_from_proto(request.remote_block_ids_per_group), ranks,
        )
        return self.node.plan_response(plans, request.summary_only)

    @rpc_errors
    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        return prefill.handshake(self.node, request, peer_names(context))

    @rpc_errors
    async def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishBlocksResponse:
        return prefill.publish(self.node, request)

    @rpc_errors
    async def ClaimLease(self, request: pb.ClaimLeaseRequest, context: grpc.aio.ServicerContext) -> pb.ClaimLeaseResponse:
        return prefill.claim(self.node, request, peer_names(context))

    @rpc_errors
    async def Transfer(self, request: pb.TransferRequest, context: grpc.aio.ServicerContext) -> pb.TransferResponse:
        return await self.decoder.transfer(request, context.time_remaining())

    @rpc_errors
    async def Notify(self, request: pb.NotifyRequest, context: grpc.aio.ServicerContext) -> pb.NotifyResponse:
        return prefill.notify(self.node, request, peer_names(context))

    async def WatchReleases(
        self, request: pb.WatchReleasesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchReleasesResponse]:
        try:
            self.node.require_role(Role.PREFILL, "WatchReleases")
        except KvsvcError as e:
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        sub = self.node.leases.subscribe()
        try:
            # Headers go out once subscribed: a caller that awaits them misses no release.
            await context.send_initial_metadata(())
            async for ev in sub:
                yield prefill.release_to_proto(ev)
        finally:
            sub.close()
