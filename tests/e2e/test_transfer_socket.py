"""The transfer socket: an engine's TransferStream on its D server's Unix socket, against
real servers and NIXL (servers in this process, so that the test can look inside them).

What must hold: an engine's channel runs there when D offers it (GetInfo, a private
directory) and on gRPC when not; hostile frames end only their own connection, with the
error in a last frame, and touch no lease; a connection that closes gives its transfers
up as a stream that ends does; a caller that does not read is paused, not buffered for;
a path that no longer connects is asked for again, then given up for gRPC; the same
socket directories are cleaned up as the lease socket's. (tests/e2e/test_transfer_stream.py
runs its transfer tests on both carriers.) The framing is written out here, not taken
from kvsvc.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import pytest
from google.rpc import status_pb2

from kvsvc.client import AsyncClient
from kvsvc.client.errors import error_from_status
from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.service import local_socket
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, in_process_pair, leases_drained, same_block_bytes

pytestmark = pytest.mark.timeout(120)


def framed(msg: pb.TransferStreamRequest | bytes) -> bytes:
    data = msg if isinstance(msg, bytes) else msg.SerializeToString()
    return len(data).to_bytes(4, "little") + data


async def read_frames(reader: asyncio.StreamReader, timeout_s: float = 10) -> list[pb.TransferStreamResponse]:
    """Every frame until the server closes the connection."""
    out = []
    while True:
        try:
            head = await asyncio.wait_for(reader.readexactly(4), timeout_s)
        except asyncio.IncompleteReadError:
            return out
        out.append(pb.TransferStreamResponse.FromString(await reader.readexactly(int.from_bytes(head, "little"))))


def stream_error(frames: list[pb.TransferStreamResponse]) -> KvsvcError:
    assert frames and frames[-1].stream_error, frames
    return error_from_status(status_pb2.Status.FromString(frames[-1].stream_error))


async def fresh_transfer(pc: AsyncClient, channel, pe: Engine, de: Engine, rid: str, p_block: int,
                         d_block: int) -> pb.TransferResponse:
    """One transfer of fresh bytes on channel; D's block must hold them, its lease end."""
    for r in pe.mem[0].regions:
        start = r.pool_offset + p_block * r.block_stride
        pe.mem[0].buf[start:start + r.block_len] = (sum(map(ord, rid)) % 251) + 1
    pub = await pc.publish_blocks(rid, [[p_block]])
    resp = await channel.transfer(f"d-{rid}", pub.params, [[d_block]], timeout_s=30)
    assert same_block_bytes(pe, p_block, de, d_block)
    assert rid not in {x.request_id for x in (await pc.list_leases()).leases}  # consumed
    return resp


async def test_the_engine_gets_a_private_socket_and_its_channel_runs_there():
    async with in_process_pair("tk") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            path = (await dc.get_info()).transfer_socket
            assert path == d.transfer_socket.path and path.endswith("/transfer.sock")
            mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
            assert mode == 0o700, oct(mode)  # only this server's user may connect
            assert not (await pc.get_info()).transfer_socket  # a prefill server offers none
            pe, de = await Engine.of(pc), await Engine.of(dc)
            channel = dc.transfer_stream()
            for i in range(3):
                await fresh_transfer(pc, channel, pe, de, f"tk{i}", 1 + i, 10 + i)
            assert channel.carrier == "socket" and channel.streams_opened == 1
            assert d.transfer_socket.connections_served == 1
            await channel.close()
            pe.close()
            de.close()
        await d.stop(0)
        assert not os.path.exists(os.path.dirname(path))  # removed at stop


async def test_without_a_socket_the_channel_runs_on_grpc():
    async with in_process_pair("tn", d_overrides={"transfer_socket": False}) as (p, d):
        assert d.transfer_socket is None
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            assert not (await dc.get_info()).transfer_socket
            pe, de = await Engine.of(pc), await Engine.of(dc)
            channel = dc.transfer_stream()
            await fresh_transfer(pc, channel, pe, de, "tn", 1, 2)
            assert channel.carrier == "grpc"
            await channel.close()
            pe.close()
            de.close()


async def test_a_path_that_no_longer_connects_is_asked_again_then_given_up():
    async with in_process_pair("ta") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            # A path from before (a server that restarted): GetInfo is asked again.
            channel = dc.transfer_stream()
            channel._socket_path = os.path.join(os.path.dirname(d.transfer_socket.path) + "x", "transfer.sock")
            await fresh_transfer(pc, channel, pe, de, "ta1", 1, 2)
            assert channel.carrier == "socket"
            await channel.close()
            # The path GetInfo gives cannot be connected to (another host's, say): gRPC.
            os.unlink(d.transfer_socket.path)
            channel = dc.transfer_stream()
            await fresh_transfer(pc, channel, pe, de, "ta2", 3, 4)
            assert channel.carrier == "grpc"
            await channel.close()
            pe.close()
            de.close()


async def test_hostile_frames_end_only_their_connection_and_touch_no_lease(monkeypatch):
    monkeypatch.setattr(local_socket, "FRAME_TIMEOUT_S", 0.3)
    async with in_process_pair("th") as (p, d):
        path = d.transfer_socket.path
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            bystander = dc.transfer_stream()
            await fresh_transfer(pc, bystander, pe, de, "warm", 1, 1)
            victim = await pc.publish_blocks("victim", [[5]])  # a live lease nobody may touch

            async def exchange(data: bytes) -> list[pb.TransferStreamResponse]:
                reader, writer = await asyncio.open_unix_connection(path)
                try:
                    writer.write(data)
                    await writer.drain()
                    return await read_frames(reader)
                finally:
                    writer.close()

            # Bytes that do not parse: the stream ends INVALID_ARGUMENT MALFORMED_REQUEST.
            err = stream_error(await exchange(framed(b"\xff\xff\xff\x0f")))
            assert (err.code, err.reason) == (ErrorCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
            # Too many transfers in one message: INVALID_ARGUMENT naming the limit.
            err = stream_error(await exchange(framed(pb.TransferStreamRequest(transfers=[pb.TransferCall()] * 1025))))
            assert (err.code, err.reason) == (ErrorCode.INVALID_ARGUMENT, "FIELD_TOO_LARGE")
            assert err.metadata.get("limit") == "1024"
            # A frame past the message limit, and half a frame: the connection closes.
            assert await exchange((1 << 30).to_bytes(4, "little") + b"x" * 16) == []
            assert await exchange(b"\x10\x00\x00\x00abc") == []  # after FRAME_TIMEOUT_S
            # A transfer without a request, and a transfer of another's lease with a forged
            # token: answers, not the stream's end.
            forged = pb.TransferParams()
            forged.CopyFrom(victim.params)
            forged.lease_token = "0" * 32
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(framed(pb.TransferStreamRequest(transfers=[pb.TransferCall(), pb.TransferCall(
                request=pb.TransferRequest(request_id="d-forged", params=forged,
                                           local_block_ids_per_group=[pb.BlockIds(block_ids=[6])]))])))
            answers: list[pb.TransferAnswer] = []
            while len(answers) < 2:
                head = await asyncio.wait_for(reader.readexactly(4), 30)
                answers += pb.TransferStreamResponse.FromString(
                    await reader.readexactly(int.from_bytes(head, "little"))).answers
            reasons = sorted((a.request_id, error_from_status(status_pb2.Status.FromString(a.error_status)).reason)
                             for a in answers)
            assert reasons == [("", "MISSING_FIELD"), ("d-forged", "LEASE_TOKEN_MISMATCH")], reasons
            writer.close()
            # Nothing of it touched the victim's lease or the bystander's stream.
            leases = {x.request_id: x.state for x in (await pc.list_leases()).leases}
            assert leases == {"victim": pb.LEASE_STATE_OFFERED}, leases
            await fresh_transfer(pc, bystander, pe, de, "after", 2, 2)
            assert bystander.streams_opened == 1 and bystander.carrier == "socket"
            await bystander.close()
            pe.close()
            de.close()


async def test_a_connection_that_closes_gives_its_transfers_up(monkeypatch):
    async with in_process_pair("tc") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            from kvsvc.service import transfer_run

            gate = asyncio.Event()
            claim_all = transfer_run.claim_all

            async def held(*args, **kwargs):  # the READ done, the claim not yet sent
                await gate.wait()
                return await claim_all(*args, **kwargs)

            monkeypatch.setattr(transfer_run, "claim_all", held)
            pub = await pc.publish_blocks("tc", [[3]])
            _reader, writer = await asyncio.open_unix_connection(d.transfer_socket.path)
            writer.write(framed(pb.TransferStreamRequest(transfers=[pb.TransferCall(request=pb.TransferRequest(
                request_id="d-tc", params=pub.params, local_block_ids_per_group=[pb.BlockIds(block_ids=[4])]))])))
            await writer.drain()
            while not d.decoder.jobs.running or not (await pc.list_leases()).leases:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # (the job reaches the claim)
            writer.close()  # the engine goes away with its transfer running
            settled = await dc.wait_transfer("d-tc", wait_ms=20_000)
            assert settled.state == pb.TRANSFER_STATE_FAILED, settled  # given up, settled
            for _ in range(100):  # the job's give-up path told P: the lease ends now, not at its TTL
                if (await pc.get_info()).live_leases == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await pc.get_info()).live_leases == 0
            gate.set()


async def test_a_caller_that_does_not_read_is_paused_not_buffered_for(monkeypatch):
    async with in_process_pair("tp") as (_p, d):
        joined = 0
        join = d.decoder.join

        def counting(*args, **kwargs):
            nonlocal joined
            joined += 1
            return join(*args, **kwargs)

        monkeypatch.setattr(d.decoder, "join", counting)
        # Each message: 1,024 transfers without a request, 1,024 error answers of ~150 bytes.
        msg = framed(pb.TransferStreamRequest(transfers=[pb.TransferCall()] * 1024))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect(d.transfer_socket.path)
        sent, stalled = 0, 0
        try:
            while sent < 2000 and stalled < 50:  # until the server stops taking what is sent
                try:
                    while True:  # in bursts: the server then reads many messages at once
                        sock.send(msg)
                        sent += 1
                        stalled = 0
                except BlockingIOError:
                    stalled += 1
                await asyncio.sleep(0.01)
            (conn,) = d.transfer_socket.conns
            assert conn._paused, f"still reading after {sent} messages"
            assert joined < sent * 1024  # it stopped taking transfers
            held = conn.transport.get_write_buffer_size()
            assert held < 1 << 20, held  # what it holds for the caller: about one message's answers
            # The caller reads again: it is answered, and the server takes the rest.
            answered, buf = 0, bytearray()
            deadline = asyncio.get_running_loop().time() + 60
            while answered < sent * 1024 and asyncio.get_running_loop().time() < deadline:
                try:
                    buf += sock.recv(1 << 20)  # (not blocking: the server runs on this loop)
                except BlockingIOError:
                    await asyncio.sleep(0.005)
                    continue
                while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "little"):
                    size = int.from_bytes(buf[:4], "little")
                    answered += len(pb.TransferStreamResponse.FromString(bytes(buf[4:4 + size])).answers)
                    del buf[:4 + size]
            assert answered == joined == sent * 1024
        finally:
            sock.close()


async def test_a_full_socket_sends_its_clients_to_grpc(monkeypatch):
    """Round three, 9: with every connection of a same-host socket taken, a new engine's
    transfer channel and a new D's lease calls used to fail (UNAVAILABLE, PEER_UNAVAILABLE
    from a healthy P); the socket now says SOCKET_FULL before closing, and both go on over
    gRPC."""
    from kvsvc.service import local_socket

    monkeypatch.setattr(local_socket, "MAX_CONNECTIONS", 2)
    async with in_process_pair("full") as (p, d):
        holders = []
        for path in (p.lease_socket.path, d.transfer_socket.path):
            for _ in range(2):  # every connection either socket takes
                holders.append(await asyncio.open_unix_connection(path))
        try:
            async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
                pub = await pc.publish_blocks("full-r", [[1]])
                channel = dc.transfer_stream()
                try:
                    resp = await channel.transfer("d-full-r", pub.params, [[2]], timeout_s=30)
                    assert resp.total_bytes > 0 and channel.carrier == "grpc"
                finally:
                    await channel.close()
                assert await leases_drained(pc) == 0, "D's claim reached P over gRPC"
                peers = list(d.decoder.peers._peers.values())
                assert peers and all(peer.lease_calls.carrier == "grpc" for peer in peers)
        finally:
            for _, writer in holders:
                writer.close()


@pytest.mark.parametrize("carrier", ["socket", "grpc"])
async def test_large_transfer_messages_break_nothing_for_their_bystanders(carrier):
    """Trust four, fix 3: one legal 4.8 MB Transfer message made the socket client count its
    stream broken (4 MiB unsent), and fourteen of them sent in one loop turn made one message
    past the 64 MiB limit: every transfer on the stream failed, bystanders too. Messages are
    bounded in bytes now: each large call gets its own answer (here a typed refusal: its
    block ids do not match the lease) and the bystanders sharing the turn succeed."""
    async with in_process_pair("tb") as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            channel = dc.transfer_stream("auto" if carrier == "socket" else carrier)  # auto: the socket here
            try:
                await fresh_transfer(pc, channel, pe, de, "warm", 1, 1)
                assert channel.carrier == carrier
                held = await pc.publish_blocks("held", [[2]])
                big = pb.TransferParams()
                big.CopyFrom(held.params)
                big.ClearField("remote_block_ids_per_group")
                ids = [2_100_000 + i for i in range(600_000)]  # 4-byte varints: 2.4 MB each side
                big.remote_block_ids_per_group.append(pb.BlockIds(block_ids=ids))
                bystanders = [await pc.publish_blocks(f"by{i}", [[3 + i]]) for i in range(4)]
                calls = [channel.transfer(f"d-big{i}", big, [ids], timeout_s=120) for i in range(14)]
                calls += [channel.transfer(f"d-by{i}", pub.params, [[10 + i]], timeout_s=120)
                          for i, pub in enumerate(bystanders)]
                out = await asyncio.gather(*calls, return_exceptions=True)  # one loop turn: one batch
                for answer in out[:14]:
                    assert isinstance(answer, KvsvcError) and answer.code is ErrorCode.INVALID_ARGUMENT, answer
                for i, answer in enumerate(out[14:]):
                    assert isinstance(answer, pb.TransferResponse), answer
                    assert same_block_bytes(pe, 3 + i, de, 10 + i)
                assert not channel._stream.ended  # the stream carried on
                await fresh_transfer(pc, channel, pe, de, "after", 8, 20)
            finally:
                await channel.close()
                pe.close()
                de.close()
