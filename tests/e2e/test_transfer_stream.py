"""TransferStream: an engine's Transfers as messages on one stream, against real servers
and NIXL. What must hold: the same bytes, answers and errors as unary Transfer; one
transfer's failure is its answer and the stream goes on; a transfer given up on the stream
(a cancelled caller, cancel_request_ids, the stream ending) is settled and frees P's lease
as a unary caller going away does; hostile messages end only their own stream; at
shutdown running transfers are answered and the stream then ends with SHUTTING_DOWN.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from google.rpc import status_pb2

from kvsvc.client import AsyncClient
from kvsvc.client.errors import error_from_rpc, error_from_status
from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, in_process_pair, layout_table, servers, session
from tests.e2e.stamps import holds, stamp

SMALL = layout_table(k=4, nb=64)
# 1 MiB blocks: a 64-block request takes tens of ms to read here.
BIG = layout_table(k=8, head=128, block=16, layers=8, nb=200)
METHOD = "/kvsvc.v1.KvTransferService/TransferStream"


@pytest.fixture(params=["socket", "grpc"])
def carrier(request: pytest.FixtureRequest) -> str:
    """What TransferChannel runs on: the D server's transfer socket (what an engine on its
    host gets) or the gRPC stream (another host, TLS)."""
    return request.param  # type: ignore[no-any-return]


def channel_on(client: AsyncClient, carrier: str):
    return client.transfer_stream("auto" if carrier == "socket" else "grpc")


def raw_stream(client: AsyncClient) -> grpc.aio.StreamStreamCall:
    """The RPC as any gRPC client in any language sees it (no kvsvc client code)."""
    return client.channel.stream_stream(METHOD, request_serializer=pb.TransferStreamRequest.SerializeToString,
                                        response_deserializer=pb.TransferStreamResponse.FromString)()


def answer_error(answer: pb.TransferAnswer) -> KvsvcError:
    assert answer.WhichOneof("result") == "error_status", answer
    return error_from_status(status_pb2.Status.FromString(answer.error_status))


async def live_leases_reach_zero(pc: AsyncClient) -> int:
    for _ in range(100):
        n = (await pc.get_info()).live_leases
        if n == 0:
            return 0
        await asyncio.sleep(0.05)
    return n


async def test_many_transfers_on_one_stream_move_the_right_bytes(carrier):
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            channel = channel_on(s.dc, carrier)
            pm, dm = s.pe.mem[0], s.de.mem[0]
            for b in range(32):
                stamp(pm, [b], 100 + b)
            pubs = [await s.pc.publish_blocks(f"st{b}", [[b]]) for b in range(32)]
            resps = await asyncio.gather(*(channel.transfer(f"d-st{b}", pubs[b].params, [[63 - b]], timeout_s=60)
                                           for b in range(32)))
            assert all(holds(dm, [63 - b], 100 + b) for b in range(32)), "a block holds another request's bytes"
            assert all(r.total_bytes == resps[0].total_bytes > 0 for r in resps)
            assert channel.streams_opened == 1 and channel.is_open and channel.carrier == carrier
            assert await live_leases_reach_zero(s.pc) == 0  # each claim reported its lease consumed
            # A retry of a finished transfer (same id, params, blocks) gets its outcome, not a second read.
            again = await channel.transfer("d-st0", pubs[0].params, [[63]], timeout_s=60)
            assert again == resps[0]
            await channel.close()


async def test_a_transfers_error_is_its_answer_as_in_unary_and_the_stream_goes_on(carrier):
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            channel = channel_on(s.dc, carrier)
            pub = await s.pc.publish_blocks("good", [[1]])
            forged = pb.TransferParams()
            forged.CopyFrom(pub.params)
            forged.lease_token = "0" * 32
            wrong_blocks = [[1, 2, 3]]  # P published one block
            cases = [("forged", forged, [[5]]), ("blocks", pub.params, wrong_blocks),
                     ("noparams", pb.TransferParams(), [[5]])]
            for name, params, ids in cases:
                with pytest.raises(KvsvcError) as on_stream:
                    await channel.transfer(f"s-{name}", params, ids, timeout_s=30)
                with pytest.raises(KvsvcError) as unary:
                    await s.dc.transfer(f"u-{name}", params, ids, timeout_s=30)
                assert (on_stream.value.code, on_stream.value.reason) == (unary.value.code, unary.value.reason), name
                assert on_stream.value.metadata == unary.value.metadata
            s.pe.fill([[1]])  # (the bad block list above made D abort the lease: blocks it cannot read)
            pub = await s.pc.publish_blocks("good-again", [[1]])
            await channel.transfer("d-good", pub.params, [[9]], timeout_s=30)
            assert not s.de.check([[9]])
            assert channel.streams_opened == 1 and channel.carrier == carrier


async def test_a_cancelled_caller_gives_the_transfer_up_settled_and_frees_the_lease(carrier):
    """As tests/e2e/test_trust.py's random cancellations, on the stream: after the transfer
    is reported settled nothing writes into its blocks, and P's leases all end."""
    with servers(1, 1, BIG) as (p, d):
        async with session(p, d) as s:
            channel = channel_on(s.dc, carrier)
            pm, dm = s.pe.mem[0], s.de.mem[0]
            stamp(pm, list(range(64)), 7)
            rng = random.Random(11)
            late_writes, states = 0, []
            for trial in range(20):
                dm.buf[:] = 0xAB
                pub = await s.pc.publish_blocks(f"c{trial}", [list(range(64))])
                call = asyncio.ensure_future(channel.transfer(f"dc{trial}", pub.params, [list(range(100, 164))],
                                                              timeout_s=60))
                await asyncio.sleep(rng.uniform(0, 0.04))
                call.cancel()
                try:
                    await call
                    states.append("done")
                    continue
                except asyncio.CancelledError:
                    pass
                settled = await s.dc.wait_transfer(f"dc{trial}", wait_ms=30_000)
                assert settled.state != pb.TRANSFER_STATE_RUNNING
                states.append(pb.TransferState.Name(settled.state))
                if settled.state == pb.TRANSFER_STATE_UNKNOWN:  # never reached D: the engine frees the lease
                    from kvsvc.client.leases import abort_published
                    await abort_published(pub.params, engine_id="e2e-decode")
                snapshot = bytes(dm.buf)
                await asyncio.sleep(0.1)
                late_writes += bytes(dm.buf) != snapshot
            assert late_writes == 0, f"{late_writes} transfers wrote after they were reported settled"
            assert "TRANSFER_STATE_FAILED" in states, states
            assert await live_leases_reach_zero(s.pc) == 0
            assert channel.streams_opened == 1  # giving one up did not end the stream
            await channel.close()


async def test_cancel_request_ids_answers_cancelled_once_settled():
    with servers(1, 1, BIG) as (p, d):
        async with session(p, d) as s:
            stamp(s.pe.mem[0], list(range(64)), 3)
            pub = await s.pc.publish_blocks("x", [list(range(64))])
            req = pb.TransferRequest(request_id="d-x", params=pub.params,
                                     local_block_ids_per_group=[pb.BlockIds(block_ids=range(100, 164))])
            call = raw_stream(s.dc)
            # Started and given up in one message: the cancel applies after the start.
            await call.write(pb.TransferStreamRequest(transfers=[pb.TransferCall(request=req, timeout_ms=30_000)],
                                                      cancel_request_ids=["d-x", "not-on-this-stream"]))
            resp = await asyncio.wait_for(call.read(), 30)
            [answer] = resp.answers
            assert answer.request_id == "d-x"
            err = answer_error(answer)
            assert (err.code, err.reason) == (ErrorCode.CANCELLED, "TRANSFER_CANCELLED")
            assert any(isinstance(x, pb.TransferFailure) for x in err.details)  # settled when answered
            state = await s.dc.wait_transfer("d-x", wait_ms=0)
            assert state.state == pb.TRANSFER_STATE_FAILED, state
            assert await live_leases_reach_zero(s.pc) == 0  # D aborted its claim, or it was never made
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF  # nothing else runs: a clean end
            assert await call.code() == grpc.StatusCode.OK


async def test_a_stream_that_ends_gives_up_its_transfers():
    with servers(1, 1, BIG) as (p, d):
        async with session(p, d) as s:
            stamp(s.pe.mem[0], list(range(64)), 5)
            pubs = [await s.pc.publish_blocks(f"e{i}", [list(range(64))]) for i in range(3)]
            call = raw_stream(s.dc)
            await call.write(pb.TransferStreamRequest(transfers=[
                pb.TransferCall(request=pb.TransferRequest(
                    request_id=f"d-e{i}", params=pubs[i].params,
                    local_block_ids_per_group=[pb.BlockIds(block_ids=range(64 * i, 64 * i + 64))]))
                for i in range(3)]))
            await asyncio.sleep(0.01)
            call.cancel()  # the engine went away mid-transfer
            for i in range(3):
                state = await s.dc.wait_transfer(f"d-e{i}", wait_ms=30_000)
                assert state.state != pb.TRANSFER_STATE_RUNNING
            assert await live_leases_reach_zero(s.pc) == 0


async def test_hostile_messages_end_only_their_own_stream():
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            bystander = s.dc.transfer_stream()
            await bystander.transfer("warm", (await s.pc.publish_blocks("w", [[1]])).params, [[1]], timeout_s=30)

            # Too many transfers in one message: the stream ends INVALID_ARGUMENT, naming the limit.
            call = raw_stream(s.dc)
            await call.write(pb.TransferStreamRequest(transfers=[pb.TransferCall()] * 1025))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 10)
            err = error_from_rpc(e.value)
            assert (err.code, err.reason) == (ErrorCode.INVALID_ARGUMENT, "FIELD_TOO_LARGE")
            assert err.metadata.get("limit") == "1024"

            # Bytes that do not parse: INVALID_ARGUMENT, MALFORMED_REQUEST.
            junk = s.dc.channel.stream_stream(METHOD, request_serializer=lambda b: b,
                                              response_deserializer=pb.TransferStreamResponse.FromString)()
            await junk.write(b"\xff\xff\xff\x0f")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(junk.read(), 10)
            assert error_from_rpc(e.value).reason == "MALFORMED_REQUEST"

            # A transfer with no request, and one id twice in a message: answers, not the stream's end.
            call = raw_stream(s.dc)
            pub = await s.pc.publish_blocks("twice", [[2]])
            req = pb.TransferRequest(request_id="d-twice", params=pub.params,
                                     local_block_ids_per_group=[pb.BlockIds(block_ids=[3])])
            await call.write(pb.TransferStreamRequest(transfers=[
                pb.TransferCall(), pb.TransferCall(request=req), pb.TransferCall(request=req)]))
            answers: list[pb.TransferAnswer] = []
            while len(answers) < 3:
                answers += (await asyncio.wait_for(call.read(), 30)).answers
            reasons = sorted((a.request_id, "OK" if a.WhichOneof("result") == "response" else answer_error(a).reason)
                             for a in answers)
            assert reasons == [("", "MISSING_FIELD"), ("d-twice", "OK"), ("d-twice", "TRANSFER_ON_STREAM")]
            await call.done_writing()

            # The bystander's stream was untouched by all of it.
            await bystander.transfer("after", (await s.pc.publish_blocks("a", [[4]])).params, [[4]], timeout_s=30)
            assert bystander.streams_opened == 1
            await bystander.close()


async def test_only_a_decode_servers_engine_may_open_one():
    with servers(1, 1, SMALL) as (p, _d):
        async with AsyncClient(p.address) as pc:
            call = raw_stream(pc)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 10)
            assert error_from_rpc(e.value).code is ErrorCode.FAILED_PRECONDITION  # a prefill server's


async def test_shutdown_answers_running_transfers_then_ends_the_stream(monkeypatch, carrier):
    async with in_process_pair("ts") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            gate = asyncio.Event()
            run = d.decoder._run

            async def held(*args):
                await gate.wait()
                return await run(*args)

            monkeypatch.setattr(d.decoder, "_run", held)
            pe.fill([[1]])
            pub = await pc.publish_blocks("held", [[1]])
            channel = channel_on(dc, carrier)
            first = asyncio.ensure_future(channel.transfer("d-held", pub.params, [[2]], timeout_s=30))
            while not d.decoder.jobs.running:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(d.stop(grace_s=20))
            while not d.servicer._streams_closed:
                await asyncio.sleep(0.01)
            late = await pc.publish_blocks("late", [[3]])
            with pytest.raises(KvsvcError) as e:  # a transfer sent while stopping: not started
                await channel.transfer("d-late", late.params, [[4]], timeout_s=30)
            assert (e.value.code, e.value.reason) == (ErrorCode.UNAVAILABLE, "SHUTTING_DOWN")
            assert channel.carrier == carrier
            gate.set()
            await first  # the running one is answered, and good
            assert not de.check([[2]])
            await asyncio.wait_for(stopping, 15)  # well within the grace: the stream ended itself
            async with asyncio.timeout(15):  # the client's reader hears of the end on its next loop turns
                while channel.is_open:
                    await asyncio.sleep(0.01)
            pe.close()
            de.close()


async def test_grpcurl_runs_transfers_on_the_stream():
    """From any language: the real grpcurl binary, JSON in and out, one message per transfer."""
    import json
    import shutil
    import sys
    from pathlib import Path

    from google.protobuf.json_format import MessageToDict

    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1]])
            s.pe.fill([[2]])  # each the first block of its request
            pubs = [await s.pc.publish_blocks(f"g{i}", [[1 + i]]) for i in range(2)]
            messages = [{"transfers": [{"request": {
                "request_id": f"d-g{i}", "params": MessageToDict(pubs[i].params, preserving_proto_field_name=True),
                "local_block_ids_per_group": [{"block_ids": [30 + i]}]}, "timeout_ms": 30000}]} for i in range(2)]
            messages.append({"transfers": [{"request": {"request_id": "d-bad"}}]})  # no params: its own error
            proc = await asyncio.create_subprocess_exec(
                grpcurl, "-plaintext", "-d", "@", d.address, "kvsvc.v1.KvTransferService/TransferStream",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate("\n".join(map(json.dumps, messages)).encode()), 60)
            assert proc.returncode == 0, err.decode()
            decoder = json.JSONDecoder()
            text, answers = out.decode(), []
            while text.strip():  # grpcurl prints one JSON object per response message
                obj, end = decoder.raw_decode(text.lstrip())
                answers += obj["answers"]
                text = text.lstrip()[end:]
            by_id = {a["request_id"]: a for a in answers}
            assert set(by_id) == {"d-g0", "d-g1", "d-bad"}
            for i in range(2):
                assert int(by_id[f"d-g{i}"]["response"]["total_bytes"]) > 0
            assert not s.de.check([[30]]) and not s.de.check([[31]])
            assert "error_status" in by_id["d-bad"]


def test_the_blocking_client_runs_transfers_on_the_stream(carrier):
    from kvsvc.client import Client

    with servers(1, 1, SMALL) as (p, d):
        with Client(p.address) as pc, Client(d.address) as dc:
            pubs = [pc.publish_blocks(f"sync{i}", [[i + 1]]) for i in range(3)]
            channel = dc.transfer_stream("auto" if carrier == "socket" else "grpc")
            resps = [channel.transfer(f"d-sync{i}", pubs[i].params, [[40 + i]], timeout_s=30) for i in range(3)]
            assert all(r.total_bytes == resps[0].total_bytes > 0 for r in resps)
            with pytest.raises(KvsvcError) as e:  # the consumed lease's own error, as unary
                channel.transfer("d-sync-again", pubs[0].params, [[45]], timeout_s=30)
            assert e.value.reason == "LEASE_EXPIRED"
            assert channel.carrier == carrier
            channel.close()


async def test_a_transfer_given_up_before_its_job_ran_still_frees_the_lease():
    """The last caller going away in the very turn the job was made (a unary caller cancelled
    at once, a stream's start and cancel in one message): the job still runs its give-up
    path, so P's lease is aborted now, not left to its TTL."""
    async with in_process_pair("gu") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc:
            pub = await pc.publish_blocks("early", [[1]], lease_ttl_ms=600_000)
            req = pb.TransferRequest(request_id="d-early", params=pub.params,
                                     local_block_ids_per_group=[pb.BlockIds(block_ids=[2])])
            job = d.decoder.join(req, 30.0)
            d.decoder.leave(job)  # in the same turn: the job has not taken a step yet
            assert job.task is not None
            await asyncio.wait_for(job.settled.wait(), 30)
            assert job.failed is not None and job.failed.cancelled
            assert await live_leases_reach_zero(pc) == 0
            state = await d.decoder.jobs.wait("d-early", 0)
            assert state.state == pb.TRANSFER_STATE_FAILED

