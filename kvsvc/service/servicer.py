"""The kvsvc.v1.KvTransferService servicer: decode requests, check the caller, call the node, encode answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_status import rpc_status

from kvsvc.codec import bad_field, block_ids_from_proto, layout_from_proto
from kvsvc.config import Role
from kvsvc.errors import KvsvcError, Unavailable
from kvsvc.leases.table import SubscriberBehind
from kvsvc.limits import (
    MAX_ADDRESS_BYTES,
    MAX_LEASE_CALLS,
    check_block_lists,
    check_count,
    check_id,
    check_num_tokens,
    check_tp_size,
    clip,
)
from kvsvc.mapping.planner import Side
from kvsvc.mapping.topology import tp_ratio
from kvsvc.reasons import Reason
from kvsvc.service import peer_transports, prefill, progressive
from kvsvc.service.auth import caller_names, is_engine, require_engine
from kvsvc.service.decode import Decoder
from kvsvc.service.errors import Malformed, rpc_errors, to_status
from kvsvc.service.inspect import list_leases
from kvsvc.service.lease_calls import LaterAnswers, LeaseCallAnswers, traced
from kvsvc.service.node import Node
from kvsvc.service.siblings import Siblings
from kvsvc.service.tracing import context_from_metadata
from kvsvc.service.transfer_stream import TransferStreamSession
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["KvTransferService"]

log = logging.getLogger(__name__)

# Answer messages of a LeaseChannel made but not yet sent, past which its next request
# message is not read (gRPC's flow control then holds the D that sends without reading).
MAX_UNSENT_ANSWERS = 4


def inline_remote_side(msg: pb.InlineRemote, field: str, local_tp_size: int) -> Side:
    if msg.tp_size == 0:
        raise bad_field(f"{field}.tp_size", "must be positive", Reason.MISSING_FIELD)
    check_tp_size(msg.tp_size, f"{field}.tp_size")
    tp_ratio(local_tp_size, msg.tp_size)  # TP_NOT_DIVISIBLE before any per-rank head check
    if not msg.HasField("layout"):
        raise bad_field(f"{field}.layout", "must be set", Reason.MISSING_FIELD)
    return Side.of(layout_from_proto(msg.layout, f"{field}.layout", msg.tp_size), msg.tp_size)


# How long shutdown waits for each open LeaseChannel to end itself with SHUTTING_DOWN.
CLOSE_CHANNELS_S = 2.0


class KvTransferServicer(pb_grpc.KvTransferServiceServicer):
    """Thin: every rule lives in the node, the role modules and the layers below them."""

    def __init__(self, node: Node, decoder: Decoder, siblings: Siblings) -> None:
        self.node = node
        self.decoder = decoder
        self.siblings = siblings
        # Open LeaseChannels: each handler's task, its context and the queue it answers from.
        self._lease_channels: dict[asyncio.Task[Any], tuple[grpc.aio.ServicerContext, asyncio.Queue[Any]]] = {}
        self.lease_answers = LeaseCallAnswers(node)  # the LeaseChannel's, on either carrier
        self._channels_closed = False
        self._transfer_streams: set[TransferStreamSession] = set()
        self._streams_closed = False

    @rpc_errors
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        info = self.node.info()
        info.engine_servers.extend(self.siblings.known.values())
        peers = self.decoder.peers.listing()
        self.decoder.transports.observe(peers)  # what the log says by now, even if no transfer ended since
        info.transport.peers.extend(peer_transports.listing(peers))
        if not is_engine(self.node, caller_names(context)):
            del info.pools[:]  # shared-memory names and CUDA IPC handles are for the engine only
            info.transfer_socket = ""
        return info

    @rpc_errors
    async def PlanTransfer(
        self, request: pb.PlanTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlanTransferResponse:
        check_block_lists([g.block_ids for g in request.local_block_ids_per_group], "local_block_ids_per_group")
        check_block_lists([g.block_ids for g in request.remote_block_ids_per_group], "remote_block_ids_per_group")
        check_num_tokens(request.remote_num_tokens, "remote_num_tokens")
        which = request.WhichOneof("remote")
        if which == "inline_remote":
            remote = inline_remote_side(request.inline_remote, "inline_remote", self.node.config.tp_size)
        elif which == "remote_address":
            check_id(request.remote_address, "remote_address", MAX_ADDRESS_BYTES)
            require_engine(self.node, caller_names(context), "plan by address (this server dials it)")
            remote = await self.decoder.peers.side_of(request.remote_address)
        else:
            raise bad_field("remote", "set inline_remote (layout + tp_size) or remote_address", Reason.MISSING_FIELD)
        ranks = self.node.check_ranks(request.local_ranks, "local_ranks")
        plans = self.node.plan(
            remote, block_ids_from_proto(request.local_block_ids_per_group),
            block_ids_from_proto(request.remote_block_ids_per_group), ranks,
            remote_num_tokens=request.remote_num_tokens,
        )
        return self.node.plan_response(plans, request.summary_only)

    @rpc_errors
    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        return prefill.handshake(self.node, request, caller_names(context))

    @rpc_errors
    async def PublishBlocks(
        self, request: pb.PublishBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishBlocksResponse:
        require_engine(self.node, caller_names(context), "publish blocks")
        return await prefill.publish(self.node, request, self.siblings)

    @rpc_errors
    async def CommitBlocks(self, request: pb.CommitBlocksRequest,
                           context: grpc.aio.ServicerContext) -> pb.CommitBlocksResponse:
        require_engine(self.node, caller_names(context), "commit blocks")
        return await progressive.commit_answered(self.node, request)

    @rpc_errors
    async def WaitCommit(self, request: pb.WaitCommitRequest, context: grpc.aio.ServicerContext) -> pb.WaitCommitResponse:
        with traced("wait_commit", request, context_from_metadata(context.invocation_metadata())):
            return await progressive.wait_commit(self.node, request, caller_names(context))

    @rpc_errors
    async def ClaimLease(self, request: pb.ClaimLeaseRequest, context: grpc.aio.ServicerContext) -> pb.ClaimLeaseResponse:
        with traced("claim", request, context_from_metadata(context.invocation_metadata())):
            return await prefill.claim_when_made(self.node, request, caller_names(context))

    @rpc_errors
    async def Transfer(self, request: pb.TransferRequest, context: grpc.aio.ServicerContext) -> pb.TransferResponse:
        require_engine(self.node, caller_names(context), "run transfers")
        return await self.decoder.transfer(request, context.time_remaining(),
                                           context_from_metadata(context.invocation_metadata()))

    async def TransferStream(
        self, request_iterator: AsyncIterator[pb.TransferStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TransferStreamResponse]:
        """Transfers as messages (service/transfer_stream.py); a transfer's error is its answer."""
        try:
            if self._streams_closed:
                raise Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down and opens no TransferStream")
            self.node.require_role(Role.DECODE, "TransferStream")
            require_engine(self.node, caller_names(context), "run transfers")
        except KvsvcError as e:
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        # Headers now: the client knows the stream was taken before it writes (a refusal comes
        # instead of them, and a write into a refused call could hide its reason).
        await context.send_initial_metadata(())
        session = TransferStreamSession(self.decoder, context.time_remaining())
        self._transfer_streams.add(session)
        try:
            async for resp in session.answers(request_iterator):
                yield resp
        except KvsvcError as e:
            log.info("TransferStream ended: %s", clip(str(e), 300))
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        finally:
            self._transfer_streams.discard(session)
        if session.closing:
            err = Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down; open a new TransferStream elsewhere")
            await context.abort_with_status(rpc_status.to_status(to_status(err)))

    def close_transfer_streams(self) -> None:
        """At shutdown: open TransferStreams take no new transfers and end with SHUTTING_DOWN
        once their running ones are answered (within the server's grace period)."""
        self._streams_closed = True
        for session in self._transfer_streams:
            session.close()

    @rpc_errors
    async def WaitTransfer(
        self, request: pb.WaitTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.WaitTransferResponse:
        require_engine(self.node, caller_names(context), "ask about transfers")
        return await self.decoder.wait(request)

    @rpc_errors
    async def Notify(self, request: pb.NotifyRequest, context: grpc.aio.ServicerContext) -> pb.NotifyResponse:
        with traced("notify", request, context_from_metadata(context.invocation_metadata())):
            return prefill.notify(self.node, request, caller_names(context))

    async def LeaseChannel(
        self, request_iterator: AsyncIterator[pb.LeaseChannelRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LeaseChannelResponse]:
        """ClaimLease and Notify calls, a message of them at a time, each message's answers in
        one message; a call's error is that call's answer and the stream goes on. A claim
        waiting for its lease (wait_ms) is answered in a message of its own when it ends
        (service/lease_calls.py)."""
        if self._channels_closed:
            err = Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down and opens no LeaseChannel")
            await context.abort_with_status(rpc_status.to_status(to_status(err)))
        names = caller_names(context)
        task = asyncio.current_task()
        out: asyncio.Queue[pb.LeaseChannelResponse | KvsvcError | None] = asyncio.Queue()
        if task is not None:
            self._lease_channels[task] = (context, out)
        taken = asyncio.Event()  # the sender took an answer from out
        later = LaterAnswers(lambda answer: out.put_nowait(pb.LeaseChannelResponse(answers=[answer])))

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    try:  # the stream cannot be trusted past a message that does not parse or is too big
                        if isinstance(msg, Malformed):
                            raise msg.error()
                        check_count(msg.calls, "calls", MAX_LEASE_CALLS)
                    except KvsvcError as e:
                        out.put_nowait(e)
                        return
                    answers = []
                    for call in msg.calls:
                        answer = self.lease_answers.answer(call, names)
                        if isinstance(answer, pb.LeaseAnswer):
                            answers.append(answer)
                        else:
                            later.start(answer)
                    if answers:
                        out.put_nowait(pb.LeaseChannelResponse(answers=answers))
                    while out.qsize() >= MAX_UNSENT_ANSWERS:  # a D that does not read its answers
                        taken.clear()                         # is not read from either
                        await taken.wait()
            except Exception as e:  # the call broke under the read (the client went): nobody to answer
                log.debug("LeaseChannel read ended: %s", e)
                out.put_nowait(None)
                return
            await later.drain()  # the client closed its side: its waiting claims are still answered
            out.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read(), name="kvsvc LeaseChannel read")
        try:
            while (item := await out.get()) is not None:
                taken.set()
                if isinstance(item, KvsvcError):
                    await context.abort_with_status(rpc_status.to_status(to_status(item)))
                else:
                    yield item
        finally:
            reader.cancel()
            later.cancel()
            if task is not None:
                self._lease_channels.pop(task, None)

    @rpc_errors
    async def ListLeases(self, request: pb.ListLeasesRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListLeasesResponse:
        require_engine(self.node, caller_names(context), "list leases")
        return list_leases(self.node, self.decoder, request)

    async def close_lease_channels(self) -> None:
        """End every open LeaseChannel with SHUTTING_DOWN (at shutdown, once no lease is claimed
        any more), and open no new one. Each handler is handed the status to end its call with,
        as it ends a stream on a bad message (the status then always reaches D: cancelled from
        outside while grpc wrote its last answer, a handler once left the call open without
        one, and D's next call on it waited out its whole timeout). A handler that has not
        ended within CLOSE_CHANNELS_S (its loop stalled) gets the status from here and is
        cancelled: the server must not wait out its grace period for it."""
        self._channels_closed = True
        err = Unavailable(Reason.SHUTTING_DOWN, "this server is shutting down")
        channels = dict(self._lease_channels)
        for _context, out in channels.values():
            out.put_nowait(err)
        if channels:
            await asyncio.wait(list(channels), timeout=CLOSE_CHANNELS_S)
        status = rpc_status.to_status(to_status(err))
        for task, (context, _out) in channels.items():
            if task.done():
                continue
            with contextlib.suppress(Exception):  # AbortError, or a call that already ended
                await context.abort_with_status(status)
            task.cancel()
        self._lease_channels.clear()

    async def WatchReleases(
        self, request: pb.WatchReleasesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchReleasesResponse]:
        try:
            if isinstance(request, Malformed):
                raise request.error()
            self.node.require_role(Role.PREFILL, "WatchReleases")
            require_engine(self.node, caller_names(context), "watch releases")
        except KvsvcError as e:
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        sub = self.node.leases.subscribe()
        try:
            # Headers go out once subscribed: a caller that awaits them misses no release.
            await context.send_initial_metadata(())
            async for ev in sub:
                yield prefill.release_to_proto(ev)
        except SubscriberBehind as e:
            log.warning("a WatchReleases subscriber stopped reading and was ended: %s", e)
            await context.abort_with_status(rpc_status.to_status(to_status(prefill.watch_behind(e))))
        finally:
            sub.close()


def _tolerant(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer that turns unparsable bytes into a Malformed marker.

    gRPC answers a deserializer's exception with UNKNOWN and logs a traceback per call;
    this way the servicer answers INVALID_ARGUMENT (MALFORMED_REQUEST) and logs one line.
    """

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            return Malformed(message_type.DESCRIPTOR.full_name, len(data), str(e))

    return parse


def add_servicer(servicer: KvTransferServicer, server: grpc.aio.Server) -> None:
    """Register every RPC of KvTransferService with tolerant request parsing."""
    handlers = {}
    for method in SERVICE.methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=_tolerant(req_cls),
                                     response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
