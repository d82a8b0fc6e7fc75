"""The lease socket: a same-host D server's lease calls on P's Unix socket, against real
servers and NIXL (servers in this process, so that the test can look inside them).

What must hold: transfers use the socket when P offers one and prove their bytes as on
the stream; the socket is a private directory's and is gone after stop; hostile frames
end only their own connection and change no lease; a D that cannot connect (or a P that
offers none) falls back to the gRPC stream; a P that restarts is found again.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.client.lease_channel import usable_socket_path
from kvsvc.config import Role, load_config
from kvsvc.service.lease_socket import remove_stale_dirs
from kvsvc.service.server import RunningServer, create_server
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, in_process_pair, leases_drained, same_block_bytes


async def d_lease_carriers(d: RunningServer) -> list[str]:
    """What D says (ListLeases, as `kvsvc leases` shows it) carries its lease calls to each peer."""
    async with AsyncClient(f"127.0.0.1:{d.port}") as dc:
        return [p.lease_carrier for p in (await dc.list_leases()).peers]


async def transfer_and_check(pc: AsyncClient, dc: AsyncClient, pe: Engine, de: Engine, rid: str,
                             p_block: int, d_block: int) -> None:
    """One transfer of fresh bytes; D's block must hold them and P's lease be settled."""
    for r in pe.mem[0].regions:  # bytes D's block does not hold yet
        start = r.pool_offset + p_block * r.block_stride
        pe.mem[0].buf[start:start + r.block_len] = (sum(map(ord, rid)) % 251) + 1
    pub = await pc.publish_blocks(rid, [[p_block]])
    await dc.transfer(f"d-{rid}", pub.params, [[d_block]])
    assert same_block_bytes(pe, p_block, de, d_block)
    assert await leases_drained(pc) == 0  # consumed: the claim (or the CONSUMED after it) reported it


async def transfers(p: RunningServer, d: RunningServer, *requests: tuple[str, int, int]) -> None:
    """transfer_and_check for each (request id, P block, D block), with clients and pools of both."""
    async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
        pe, de = await Engine.of(pc), await Engine.of(dc)
        try:
            for rid, p_block, d_block in requests:
                await transfer_and_check(pc, dc, pe, de, rid, p_block, d_block)
        finally:
            pe.close()
            de.close()


async def test_transfers_use_the_socket_and_it_is_private_and_removed():
    async with in_process_pair("ls") as (p, d):
        path = p.node.lease_socket_path
        assert path and usable_socket_path(path) == path
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # only this user may connect
        await transfers(p, d, *((f"sock-{i}", 3 + i, 10 + i) for i in range(5)))
        assert await d_lease_carriers(d) == ["socket"]
        assert p.lease_socket is not None and p.lease_socket.connections_served == 1
    assert not os.path.exists(os.path.dirname(path))  # stop removed the socket and its directory


async def test_without_a_socket_lease_calls_go_over_grpc():
    async with in_process_pair("ls", lease_socket=False) as (p, d):
        assert p.lease_socket is None and p.node.lease_socket_path == ""
        await transfers(p, d, ("grpc-0", 3, 10))
        assert await d_lease_carriers(d) == ["grpc"]


async def test_a_server_that_cannot_make_its_socket_serves_without_one(monkeypatch):
    import tempfile

    mkdtemp = tempfile.mkdtemp

    def no_room(*args, prefix=None, **kwargs):  # kvsvc's socket directories only: NIXL's own use works
        if prefix and prefix.startswith("kvsvc-"):
            raise FileNotFoundError("no room in the temp dir")
        return mkdtemp(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", no_room)
    async with in_process_pair("ls") as (p, d):
        assert p.lease_socket is None and p.node.lease_socket_path == ""
        assert d.transfer_socket is None and d.node.transfer_socket_path == ""  # nor D's
        monkeypatch.undo()
        await transfers(p, d, ("notmp-0", 3, 10))
        assert await d_lease_carriers(d) == ["grpc"]


async def test_a_socket_that_cannot_be_reached_falls_back_to_grpc():
    """The path names a socket D cannot connect to (as from a P server on another host)."""
    async with in_process_pair("ls") as (p, d):
        assert p.lease_socket is not None
        os.unlink(p.lease_socket.path)  # still offered in the handshake, no longer there
        await transfers(p, d, ("fallback-0", 3, 10), ("fallback-1", 4, 11))
        assert await d_lease_carriers(d) == ["grpc"]


async def raw_exchange(path: str, payload: bytes, wait_s: float = 1.0) -> bytes:
    """Send payload on a fresh connection; everything P answers before it closes (or wait_s)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(1 << 20), wait_s)
    except TimeoutError:
        return b"(still open)"
    finally:
        writer.close()


def framed(msg: pb.LeaseChannelRequest) -> bytes:
    data = msg.SerializeToString()  # the framing written out here, not taken from kvsvc
    return len(data).to_bytes(4, "little") + data


async def test_hostile_frames_end_their_connection_and_touch_no_lease(monkeypatch):
    from kvsvc.service import local_socket

    monkeypatch.setattr(local_socket, "FRAME_TIMEOUT_S", 0.3)
    async with in_process_pair("ls") as (p, _d):
        assert p.lease_socket is not None
        path = p.lease_socket.path
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc:
            pub = await pc.publish_blocks("victim", [[5]])
            token = pub.params.lease_token
            bad = [
                (1 << 31).to_bytes(4, "little") + b"x" * 16,  # a length over the limit
                (7).to_bytes(4, "little") + b"\xff" * 7,  # not a LeaseChannelRequest
                framed(pb.LeaseChannelRequest(calls=[pb.LeaseCall(call_id=i) for i in range(5000)])),  # too many
                b"\x01\x00",  # a header cut short, then nothing (closed after FRAME_TIMEOUT_S)
                (100).to_bytes(4, "little") + b"\x08",  # a body cut short, likewise
            ]
            for payload in bad:
                got = await raw_exchange(path, payload, wait_s=5.0)
                assert got == b"", (payload[:8], got[:64])  # closed, nothing answered
            # A well-formed call gets an answer (the framing written out here): an abort
            # without the token is refused and leaves the lease as it was.
            call = pb.LeaseCall(call_id=7, notify=pb.NotifyRequest(
                request_id="victim", kind=pb.NOTIFY_KIND_ABORTED, lease_epoch=pub.params.remote_epoch,
                lease_token="not-the-token"))
            got = await raw_exchange(path, framed(pb.LeaseChannelRequest(calls=[call])))
            size = int.from_bytes(got[:4], "little")
            answer = pb.LeaseChannelResponse.FromString(got[4:4 + size]).answers[0]
            assert answer.call_id == 7 and answer.WhichOneof("result") == "error_status"
            info = await pc.get_info()
            assert info.live_leases == 1
            # The server still answers everyone, and the lease is still the token holder's.
            from kvsvc.client.leases import abort_published
            answers = await abort_published(pub.params, engine_id="router")
            assert token and list(answers.values()) == ["LEASE_STATE_ABORTED"], answers


async def test_a_restarted_prefill_server_is_found_again():
    async with in_process_pair("ls") as (p, d):
        async with AsyncClient(f"127.0.0.1:{d.port}") as dc:
            async with AsyncClient(f"127.0.0.1:{p.port}") as pc:
                pe, de = await Engine.of(pc), await Engine.of(dc)
                try:
                    await transfer_and_check(pc, dc, pe, de, "before", 3, 10)
                finally:
                    pe.close()
            old_path = p.node.lease_socket_path
            port = p.port
            await p.stop(0)
            p2, _ = await create_server(load_config(listen=f"127.0.0.1:{port}", tp_size=1, engine_id="ls-p",
                                                    role=Role.PREFILL))
            try:
                assert p2.node.lease_socket_path != old_path
                async with AsyncClient(f"127.0.0.1:{port}") as pc:
                    pe = await Engine.of(pc)
                    try:
                        await transfer_and_check(pc, dc, pe, de, "after", 4, 11)
                    finally:
                        pe.close()
                        de.close()
                assert p2.lease_socket is not None and p2.lease_socket.connections_served == 1
            finally:
                await p2.stop(0)


async def test_the_directory_of_a_killed_server_is_removed_and_live_ones_are_kept(tmp_path):
    """A P server killed with SIGKILL leaves its socket's directory; the next server's start
    removes it (real server processes), never a live server's or a stranger's directory."""
    table = {"model_id": "m", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 8, "dtype": "bfloat16",
             "groups": [{"name": "full", "kind": "full_attention", "num_layers": 1, "head_size": 64}]}
    env = {"TMPDIR": str(tmp_path)}  # their sockets' directories, apart from other servers'
    killed = start_server(engine_id="ls-killed", role="prefill", tp_size=1, layout=table, extra_env=env)
    live = start_server(engine_id="ls-live", role="prefill", tp_size=1, layout=table, extra_env=env)
    try:
        paths = {}
        for name, sp in (("killed", killed), ("live", live)):
            async with AsyncClient(sp.address) as c:
                layout = (await c.get_info()).layout
                hs = await c.handshake(pb.HandshakeRequest(engine_id="ls-d", tp_size=1, layout=layout))
                paths[name] = hs.lease_socket
        assert all(paths.values())
        killed.kill()
        assert os.path.exists(paths["killed"])  # SIGKILL: nobody removed it
        assert os.path.dirname(os.path.dirname(paths["killed"])) == str(tmp_path)
        assert remove_stale_dirs(str(tmp_path), min_age_s=60) == 0  # too young for a server's start to remove
        assert remove_stale_dirs(str(tmp_path), min_age_s=0) == 1
        assert not os.path.exists(os.path.dirname(paths["killed"]))
        assert os.path.exists(paths["live"])  # answers: kept
    finally:
        live.stop()
        killed.stop()  # already dead: collects its output
    assert not os.path.exists(os.path.dirname(paths["live"]))  # a clean stop removes its own


def test_only_stale_kvsvc_socket_directories_go(tmp_path):
    def make(name: str, *, sock: str = "", extra: str = "", mode: int = 0o700) -> str:
        d = tmp_path / name
        d.mkdir(mode=mode)
        os.chmod(d, mode)
        if sock:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / sock))  # bound, never listened on, then closed: connect is refused
            s.close()
        if extra:
            (d / extra).write_text("x")
        old = time.time() - 3600
        os.utime(d, (old, old))
        return str(d)

    stale = make("kvsvc-0123abcd-a1b2c3d4", sock="lease.sock")
    stale_transfer = make("kvsvc-0123abcd-b1b2c3d4", sock="transfer.sock")  # a D server's
    empty = make("kvsvc-0123abcd-emptydir")
    other_sock = make("kvsvc-0123abcd-othersck", sock="other.sock")
    other_file = make("kvsvc-0123abcd-hasfile1", sock="lease.sock", extra="notes.txt")
    bad_name = make("kvsvc-notours", sock="lease.sock")
    wide_mode = make("kvsvc-0123abcd-widemode", sock="lease.sock", mode=0o755)
    fresh = make("kvsvc-0123abcd-freshdir", sock="lease.sock")
    os.utime(fresh, None)  # just made: a server may be starting in it
    assert remove_stale_dirs(str(tmp_path)) == 3
    assert not any(os.path.exists(p) for p in (stale, stale_transfer, empty))
    assert all(os.path.exists(p) for p in (other_file, other_sock, bad_name, wide_mode, fresh))


async def test_frames_split_anywhere_or_sent_together_are_all_answered_in_order():
    """P reads frames out of whatever the socket delivers: one byte at a time, or several
    frames in one write; each gets its answer, in order."""
    async with in_process_pair("ls") as (p, _d):
        assert p.lease_socket is not None
        calls = [pb.LeaseCall(call_id=i, notify=pb.NotifyRequest(
            request_id=f"nobody-{i}", kind=pb.NOTIFY_KIND_HEARTBEAT, engine_id="x", tp_size=1)) for i in range(1, 7)]
        payload = b"".join(framed(pb.LeaseChannelRequest(calls=[c])) for c in calls[:3])  # three frames at once
        reader, writer = await asyncio.open_unix_connection(p.lease_socket.path)
        try:
            writer.write(payload)
            for c in calls[3:]:  # then three more, a byte at a time
                for byte in framed(pb.LeaseChannelRequest(calls=[c])):
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0)
            got = []
            while len(got) < len(calls):
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "little")
                got += pb.LeaseChannelResponse.FromString(await reader.readexactly(size)).answers
            assert [a.call_id for a in got] == [c.call_id for c in calls]
            assert all(a.WhichOneof("result") in ("notify", "error_status") for a in got)
        finally:
            writer.close()


def test_a_p_server_that_stops_reading_breaks_the_socket_past_the_bound():
    """D never waits for the lease socket to drain; unsent bytes past MAX_UNSENT_BYTES, found
    before a loop turn's writes (the multiplexer asks then), end it."""
    from kvsvc import framing
    from kvsvc.client.socket_call import SocketCall

    class StuckTransport:
        def __init__(self) -> None:
            self.buffered = 0

        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            self.buffered += len(data)

        def get_write_buffer_size(self) -> int:
            return self.buffered

    call = SocketCall(1 << 20, pb.LeaseChannelResponse.FromString, "the lease socket")
    transport = StuckTransport()
    call.connection_made(transport)  # type: ignore[arg-type]
    msg = pb.LeaseChannelRequest(calls=[pb.LeaseCall(call_id=1, notify=pb.NotifyRequest(request_id="r" * 200))])
    sent = 0
    with pytest.raises(ConnectionResetError):
        while sent < 10 * framing.MAX_UNSENT_BYTES:
            call.check_reading()
            call.write_now(msg)
            sent += 1
    assert framing.MAX_UNSENT_BYTES < transport.buffered <= framing.MAX_UNSENT_BYTES + 1024
