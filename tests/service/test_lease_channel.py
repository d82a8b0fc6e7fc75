"""LeaseChannel: ClaimLease and Notify as messages on one stream, against a real P server in-process.

The channel must answer exactly what the unary calls answer (values and typed errors), keep
going after a call's error, match answers to calls when many share a message, refuse bytes
that do not parse or too many calls at once, and fall back to unary calls on a server
without it.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import status_pb2

from kvsvc.client import AsyncClient
from kvsvc.client.errors import error_from_status
from kvsvc.client.lease_channel import LeaseChannel
from kvsvc.client.multiplex import Multiplexer
from kvsvc.config import MemoryMode, Role, load_config
from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, PermissionDenied
from kvsvc.limits import MAX_LEASE_CALLS
from kvsvc.service import prefill as prefill_role
from kvsvc.service.server import create_server
from kvsvc.v1 import kv_transfer_pb2 as pb

METHOD = "/kvsvc.v1.KvTransferService/LeaseChannel"


def claim(pub: pb.PublishBlocksResponse, claim_id: str, **kw) -> pb.ClaimLeaseRequest:
    p = pub.params
    return pb.ClaimLeaseRequest(request_id=p.remote_request_id, lease_epoch=p.remote_epoch, engine_id="D",
                                tp_size=1, lease_token=p.lease_token, claim_id=claim_id, **kw)


def consumed(pub: pb.PublishBlocksResponse, claim_id: str) -> pb.NotifyRequest:
    p = pub.params
    return pb.NotifyRequest(request_id=p.remote_request_id, kind=pb.NOTIFY_KIND_CONSUMED, engine_id="D", tp_size=1,
                            done_ranks=[0], lease_epoch=p.remote_epoch, lease_token=p.lease_token, claim_id=claim_id)


async def test_answers_and_errors_match_the_unary_calls(prefill):
    server, client = prefill
    lane = client.lease_channel()
    try:
        a, b = await client.publish_blocks("a", [[1]]), await client.publish_blocks("b", [[2]])
        granted = await lane.claim_lease(claim(a, "c" * 16))
        assert 0 < granted.lease_remaining_ms <= 30_000
        # The same refusals, typed the same way, through either path.
        wrong_token = claim(b, "d" * 16)
        wrong_token.lease_token = "not-the-token"
        for call in (lane.claim_lease, client.claim_lease):
            with pytest.raises(PermissionDenied) as e:
                await call(wrong_token)
            assert e.value.reason == "LEASE_TOKEN_MISMATCH" and e.value.metadata == {"request_id": "b"}
        with pytest.raises(FailedPrecondition) as e:
            await lane.claim_lease(claim(a, "e" * 16))  # another claimant of a claimed lease
        assert e.value.reason == "LEASE_CLAIMED"
        # The stream went on after the errors: the owner consumes.
        done = await lane.notify(consumed(a, "c" * 16))
        assert done.state == pb.LEASE_STATE_CONSUMED and not done.pending_ranks
        assert server.node.leases.get("a") is None and server.node.leases.get("b") is not None
        # A repeated notification answers the final state, as Notify does.
        assert (await lane.notify(consumed(a, "c" * 16))).state == pb.LEASE_STATE_CONSUMED
    finally:
        await lane.close()


async def test_many_calls_in_flight_are_matched_to_their_callers(prefill):
    server, client = prefill
    lane = client.lease_channel()
    try:
        pubs = [await client.publish_blocks(f"r{i}", [[i % 64]]) for i in range(200)]
        # Every other lease is claimed with a bad token: answers must not be swapped.
        reqs = []
        for i, pub in enumerate(pubs):
            req = claim(pub, f"claim-{i:012d}")
            if i % 2:
                req.lease_token = "x"
            reqs.append(req)
        outcomes = await asyncio.gather(*(lane.claim_lease(r) for r in reqs), return_exceptions=True)
        for i, out in enumerate(outcomes):
            if i % 2:
                assert isinstance(out, PermissionDenied) and out.metadata["request_id"] == f"r{i}", out
            else:
                assert isinstance(out, pb.ClaimLeaseResponse), out
        done = await asyncio.gather(*(lane.notify(consumed(pubs[i], f"claim-{i:012d}")) for i in range(0, 200, 2)))
        assert all(d.state == pb.LEASE_STATE_CONSUMED for d in done)
        assert server.node.leases.live_count == 100
    finally:
        await lane.close()


async def test_a_call_without_a_body_is_refused_alone(prefill):
    _, client = prefill
    pub = await client.publish_blocks("a", [[1]])
    call = client.channel.stream_stream(METHOD, request_serializer=pb.LeaseChannelRequest.SerializeToString,
                                        response_deserializer=pb.LeaseChannelResponse.FromString)()
    await call.write(pb.LeaseChannelRequest(calls=[pb.LeaseCall(call_id=7), pb.LeaseCall(call_id=8, claim=claim(
        pub, "c" * 16))]))
    resp = await call.read()
    first, second = resp.answers
    assert first.call_id == 7 and first.WhichOneof("result") == "error_status"
    decoded = error_from_status(status_pb2.Status.FromString(first.error_status))
    assert isinstance(decoded, InvalidArgument) and decoded.reason == "MISSING_FIELD"
    assert second.call_id == 8 and second.WhichOneof("result") == "claim"
    call.cancel()


@pytest.mark.parametrize("what", ["garbage", "too_many"])
async def test_bad_messages_end_the_stream_with_invalid_argument(prefill, what):
    server, client = prefill
    if what == "garbage":
        call = client.channel.stream_stream(METHOD)()  # raw bytes: no serializer
        await call.write(b"\xff\xff\xff not a protobuf")
        reason = "MALFORMED_REQUEST"
    else:
        call = client.channel.stream_stream(METHOD, request_serializer=pb.LeaseChannelRequest.SerializeToString)()
        await call.write(pb.LeaseChannelRequest(calls=[pb.LeaseCall(call_id=i) for i in range(MAX_LEASE_CALLS + 1)]))
        reason = "FIELD_TOO_LARGE"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in e.value.details()
    assert (await client.get_info()).engine_id == server.node.config.engine_id  # still serving


async def test_a_server_without_lease_channel_gets_unary_calls():
    """An older P server answers UNIMPLEMENTED: the channel says so once and goes unary."""
    seen: list[str] = []

    async def unary_claim(request, context):
        seen.append("ClaimLease")
        return pb.ClaimLeaseResponse(lease_remaining_ms=1234)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvsvc.v1.KvTransferService", {
        "ClaimLease": grpc.unary_unary_rpc_method_handler(
            unary_claim, request_deserializer=pb.ClaimLeaseRequest.FromString,
            response_serializer=pb.ClaimLeaseResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            lane = LeaseChannel(client)
            req = pb.ClaimLeaseRequest(request_id="r", claim_id="c" * 16)
            assert (await lane.claim_lease(req)).lease_remaining_ms == 1234
            assert (await lane.claim_lease(req)).lease_remaining_ms == 1234
            assert seen == ["ClaimLease", "ClaimLease"]
            await lane.close()
    finally:
        await server.stop(0)


async def test_a_lost_server_is_unavailable_and_a_closed_channel_refuses():
    running, port = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, role=Role.PREFILL,
                                                    memory=MemoryMode.NONE))
    async with AsyncClient(f"127.0.0.1:{port}") as client:
        lane = client.lease_channel()
        hb = pb.NotifyRequest(request_id="r", kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id="D", tp_size=1,
                              lease_epoch=running.node.epoch, lease_token="t", claim_id="c" * 16)
        assert (await lane.notify(hb)).state == pb.LEASE_STATE_UNKNOWN
        await running.stop(0)
        with pytest.raises(KvsvcError) as e:
            await lane.notify(hb, timeout_s=2)
        assert e.value.code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED)
        await lane.close()
        with pytest.raises(KvsvcError) as e:
            await lane.notify(hb)
        assert e.value.code is ErrorCode.UNAVAILABLE


async def test_shutdown_ends_open_channels_with_shutting_down(prefill):
    """Draining ends every open channel with a status (a stream left open would hold the
    server's shutdown for its whole grace period), and refuses new ones."""
    server, client = prefill
    lane = client.lease_channel()
    hb = pb.NotifyRequest(request_id="r", kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id="D", tp_size=1,
                          lease_epoch=server.node.epoch, lease_token="t", claim_id="c" * 16)
    assert (await lane.notify(hb)).state == pb.LEASE_STATE_UNKNOWN
    await server.servicer.close_lease_channels()
    with pytest.raises(KvsvcError) as e:
        await lane.notify(hb)
    assert (e.value.code, e.value.reason) == (ErrorCode.UNAVAILABLE, "SHUTTING_DOWN")
    assert not server.servicer._lease_channels
    await lane.close()


class _StuckCall:
    """A stream whose writes never complete and which never answers (a wedged transport)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.writes = 0

    async def write(self, message) -> None:
        self.writes += 1
        await asyncio.Event().wait()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def test_a_write_stuck_past_the_deadline_fails_the_call_and_ends_the_stream():
    """The call's deadline covers the write too: the caller gets DEADLINE_EXCEEDED in time,
    the wedged stream is cancelled, and the next call opens a fresh one."""
    from kvsvc.client import lease_channel as lc
    from kvsvc.errors import DeadlineExceeded

    async with AsyncClient("127.0.0.1:1") as client:
        lane = LeaseChannel(client)
        calls: list[_StuckCall] = []

        async def fake_open() -> Multiplexer:
            if lane._stream is None or lane._stream.ended:
                calls.append(_StuckCall())
                lane._stream = lc.lease_stream(calls[-1])
            return lane._stream

        lane._open = fake_open  # type: ignore[method-assign]
        hb = pb.NotifyRequest(request_id="r", kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id="D", tp_size=1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(DeadlineExceeded):
            await lane.notify(hb, timeout_s=0.2)
        assert loop.time() - started < 5  # answered at its deadline, not whenever the write ends
        assert calls[0].cancelled and calls[0].writes == 1
        assert not lane.is_open
        with pytest.raises(DeadlineExceeded):
            await lane.notify(hb, timeout_s=0.1)
        assert len(calls) == 2 and calls[1].writes == 1
        await lane.close()


@pytest.mark.parametrize("path, ok", [
    ("/tmp/kvsvc-0000abcd-x1y2/lease.sock", True),
    ("/run/user/1000/kvsvc-1-a/lease.sock", True),
    ("/var/run/docker.sock", False),  # a peer may not point D at another service's socket
    ("/tmp/kvsvc-1-a/other.sock", False),
    ("/tmp/elsewhere/lease.sock", False),
    ("relative/kvsvc-1/lease.sock", False),
    ("/tmp/kvsvc-1-a/../lease.sock", False),
    ("/" + "a" * 120 + "/kvsvc-1/lease.sock", False),  # longer than a socket address holds
    ("", False),
])
def test_only_lease_socket_paths_of_kvsvcs_shape_are_used(path, ok):
    from kvsvc.client.lease_channel import usable_socket_path

    assert usable_socket_path(path) == (path if ok else "")


async def test_a_server_without_transfer_stream_gets_unary_transfers():
    """An older D server answers the TransferStream UNIMPLEMENTED: the client's channel goes
    unary for good, and a transfer waiting on the stream is sent again as a call."""
    seen: list[str] = []

    async def unary_transfer(request, context):
        seen.append(request.request_id)
        return pb.TransferResponse(total_bytes=len(request.request_id))

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvsvc.v1.KvTransferService", {
        "Transfer": grpc.unary_unary_rpc_method_handler(
            unary_transfer, request_deserializer=pb.TransferRequest.FromString,
            response_serializer=pb.TransferResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            channel = client.transfer_stream()
            params = pb.TransferParams(remote_address="127.0.0.1:1", remote_request_id="r")
            first = await channel.transfer("d-one", params, [[1]], timeout_s=10)
            second = await channel.transfer("d-three", params, [[1]], timeout_s=10)
            assert (first.total_bytes, second.total_bytes) == (5, 7)
            assert seen == ["d-one", "d-three"] and channel.streams_opened == 1 and not channel.is_open
            await channel.close()
    finally:
        await server.stop(0)


async def test_a_retried_claim_and_consumed_is_answered_consumed_on_either_path(prefill):
    """D's lease channel retries a call once when its stream breaks before the answer: a
    claim-and-consumed that P had applied must then be answered CONSUMED again (D's READs
    were good), not LEASE_EXPIRED; another claim id still gets LEASE_EXPIRED."""
    _, client = prefill
    lane = client.lease_channel()
    try:
        pub = await client.publish_blocks("retried", [[1]])
        first = await lane.claim_lease(claim(pub, "r" * 16, consumed=True))
        assert first.state == pb.LEASE_STATE_CONSUMED
        for call in (lane.claim_lease, client.claim_lease):
            again = await call(claim(pub, "r" * 16, consumed=True))
            assert again.state == pb.LEASE_STATE_CONSUMED
        with pytest.raises(FailedPrecondition) as e:
            await lane.claim_lease(claim(pub, "s" * 16, consumed=True))
        assert e.value.reason == "LEASE_EXPIRED"
    finally:
        await lane.close()


async def test_a_claim_that_waits_is_answered_when_the_lease_is_made_on_either_path(prefill):
    """wait_ms: a claim for a lease not made yet is held on P (unary or on the stream, where
    the calls behind it are answered first) and granted once the engine leases the blocks;
    a wait over the limit is refused before anything waits."""
    server, client = prefill
    lane = client.lease_channel()
    arrivals = server.node.leases.arrivals
    try:
        token = "w" * 32
        future = pb.PublishBlocksResponse(params=pb.TransferParams(
            remote_request_id="soon", remote_epoch=server.node.epoch, lease_token=token))
        unary = asyncio.ensure_future(client.claim_lease(claim(future, "u" * 16, ranks=[0], wait_ms=30_000)))
        streamed = asyncio.ensure_future(lane.claim_lease(claim(future, "v" * 16, ranks=[0], wait_ms=30_000)))
        other = await client.publish_blocks("other", [[2]])
        # Answered while the claims wait; its answer overtakes theirs on the stream.
        assert (await lane.claim_lease(claim(other, "o" * 16))).state == pb.LEASE_STATE_CLAIMED
        assert not unary.done() and not streamed.done() and arrivals.waiting == 2
        await prefill_role.publish(server.node, pb.PublishBlocksRequest(  # as an engine's worker does, in process
            request_id="soon", lease_token=token, block_ids_per_group=[pb.BlockIds(block_ids=[1])]), server.siblings)
        answers = await asyncio.wait_for(asyncio.gather(unary, streamed, return_exceptions=True), 30)
        # Both woke; one D rank has one owner, so exactly one of the two claims holds it.
        granted = [a for a in answers if isinstance(a, pb.ClaimLeaseResponse)]
        refused = [a for a in answers if isinstance(a, KvsvcError)]
        assert len(granted) == 1 and granted[0].state == pb.LEASE_STATE_CLAIMED
        assert len(refused) == 1 and refused[0].reason == "LEASE_CLAIMED"
        assert arrivals.waiting == 0
        for call in (lane.claim_lease, client.claim_lease):
            with pytest.raises(InvalidArgument) as e:
                await call(claim(future, "x" * 16, wait_ms=60_001))
            assert e.value.reason == "FIELD_TOO_LARGE" and e.value.metadata["field"] == "wait_ms"
    finally:
        await lane.close()


async def test_a_client_that_closes_its_side_still_hears_its_waiting_claim(prefill):
    """grpcurl and other one-shot clients send their calls, close their side, then read: a claim
    still waiting for its lease at that moment is answered, not dropped with the stream."""
    server, client = prefill
    token = "h" * 32
    future = pb.PublishBlocksResponse(params=pb.TransferParams(
        remote_request_id="half", remote_epoch=server.node.epoch, lease_token=token))
    arrivals, waiting = server.node.leases.arrivals, asyncio.Event()
    real_wait = arrivals.wait

    async def wait(*args):
        waiting.set()
        return await real_wait(*args)

    arrivals.wait = wait
    call = client.channel.stream_stream(METHOD, request_serializer=pb.LeaseChannelRequest.SerializeToString,
                                        response_deserializer=pb.LeaseChannelResponse.FromString)()
    await call.write(pb.LeaseChannelRequest(calls=[pb.LeaseCall(call_id=7, claim=claim(future, "k" * 16,
                                                                                         wait_ms=30_000))]))
    await call.done_writing()
    await asyncio.wait_for(waiting.wait(), 30)  # the claim reached P and waits there
    await prefill_role.publish(server.node, pb.PublishBlocksRequest(
        request_id="half", lease_token=token, block_ids_per_group=[pb.BlockIds(block_ids=[3])]), server.siblings)
    answers = [a async for resp in call for a in resp.answers]
    assert [(a.call_id, a.claim.state) for a in answers] == [(7, pb.LEASE_STATE_CLAIMED)]
