"""Trust under retries, faults and hostile input, over real server processes (docs/RELIABILITY.md).

Each test names the promise it checks: one owner per lease, peers never pulled from
under transfers, flat file descriptors, bounded fields, settled blocks after a
cancellation, leases that only their holders can touch, typed errors for dead peers
and malformed bytes, a prefill server that drains before it stops.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import stat
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.client.errors import error_from_status
from kvsvc.client.leases import abort_published
from kvsvc.codec import layout_to_proto
from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, PermissionDenied, Unavailable
from kvsvc.layout import layout_from_dict
from kvsvc.service.transfer_run import ABORT_TIMEOUT_S
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, ReleaseWatch, in_process_pair, layout_table, leases_drained, servers, session
from tests.e2e.stamps import holds, stamp
from tests.e2e.test_read_then_claim import engines

SMALL = layout_table(k=4, nb=64)
# 1 MiB blocks (8 layers x K and V x 64 KiB): a 64-block request takes tens of ms to read here.
BIG = layout_table(k=8, head=128, block=16, layers=8, nb=200)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_concurrent_duplicate_transfers_never_report_wrong_bytes():
    """Item 1: a router retrying while the first attempt runs; P reuses blocks as soon as they are released."""
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            pm, dm = s.pe.mem[0], s.de.mem[0]
            for trial in range(20):
                seed = trial + 1
                stamp(pm, [1, 2, 3], seed)
                pub = await s.pc.publish_blocks(f"dup{trial}", [[1, 2, 3]])
                reused = asyncio.ensure_future(_reuse_on_release(s.watch, f"dup{trial}", pm, [1, 2, 3]))
                # Same D request id (a retry) and a different one (a second router), at once.
                runs = await asyncio.gather(
                    s.dc.transfer(f"d{trial}", pub.params, [[10, 11, 12]]),
                    s.dc.transfer(f"d{trial}", pub.params, [[10, 11, 12]]),
                    s.dc.transfer(f"x{trial}", pub.params, [[20, 21, 22]]),
                    return_exceptions=True)
                await reused
                first, retry, other = runs
                # The retry joined the first attempt: the same outcome, whichever it was.
                if isinstance(first, BaseException):
                    assert isinstance(retry, KvsvcError) and retry.reason == first.reason
                else:
                    assert retry == first
                # Whichever id won the claim read the right bytes; the other was refused, typed.
                winners = [(r, ids) for r, ids in ((first, [10, 11, 12]), (other, [20, 21, 22]))
                           if not isinstance(r, BaseException)]
                assert len(winners) == 1, runs
                assert holds(dm, winners[0][1], seed), "a transfer reported good bytes it did not get"
                for r in (first, other):
                    if isinstance(r, BaseException):
                        assert isinstance(r, KvsvcError) and r.reason in ("LEASE_CLAIMED", "LEASE_EXPIRED"), r
                assert await leases_drained(s.pc) == 0


async def _reuse_on_release(watch: ReleaseWatch, rid: str, mem, ids: list[int]) -> None:
    """The P engine writes another request into the blocks the moment they come back."""
    await watch.wait_for(rid, timeout_s=10)
    stamp(mem, ids, 999_999)


async def test_stale_epoch_breaks_nobody_and_keeps_fds_flat():
    """Items 2 and 3: stale params after a restart never disturb transfers in flight; no socket leaks."""
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1]])
            warm = await s.pc.publish_blocks("warm", [[1]])
            await s.dc.transfer("d-warm", warm.params, [[2]])
            before = (fds(p.proc.pid), fds(d.proc.pid))

            async def good(i: int) -> None:
                pub = await s.pc.publish_blocks(f"g{i}", [[i % 8 + 1]])
                await s.dc.transfer(f"d-g{i}", pub.params, [[i % 8 + 20]])

            async def stale(i: int) -> str:
                pub = await s.pc.publish_blocks(f"s{i}", [[i % 8 + 30]])
                pub.params.remote_epoch = pub.params.remote_servers[0].epoch = 12345 + i  # as if P restarted
                with pytest.raises(FailedPrecondition) as e:
                    await s.dc.transfer(f"d-s{i}", pub.params, [[i % 8 + 40]])
                return e.value.reason

            for round_ in range(5):
                out = await asyncio.gather(*(good(100 * round_ + i) for i in range(20)),
                                           *(stale(100 * round_ + i) for i in range(20)), return_exceptions=True)
                assert [o for o in out if isinstance(o, BaseException)] == []
                assert set(out[20:]) == {"LEASE_EXPIRED"}
            for i in range(200):
                await stale(1000 + i)
            after = (fds(p.proc.pid), fds(d.proc.pid))
            assert after == before, f"file descriptors grew: {before} -> {after}"
            # P leases of the stale requests are released at once (D aborted them), not at TTL.
            assert (await s.pc.get_info()).live_leases <= 300


async def test_every_field_is_bounded_with_a_typed_error():
    """Item 4: oversized fields are INVALID_ARGUMENT (FIELD_TOO_LARGE) before any work; details stay small."""
    with servers(1, 1, SMALL) as (p, d):
        async with AsyncClient(p.address, ClientOptions(retries=0)) as pc, \
                AsyncClient(d.address, ClientOptions(retries=0)) as dc:
            layout = layout_to_proto(layout_from_dict(SMALL, 1))
            started = time.monotonic()
            with pytest.raises(InvalidArgument) as e:
                await dc.plan_transfer(pb.PlanTransferRequest(
                    inline_remote=pb.InlineRemote(layout=layout, tp_size=1 << 26),
                    local_block_ids_per_group=[pb.BlockIds(block_ids=[1])],
                    remote_block_ids_per_group=[pb.BlockIds(block_ids=[1])]))
            assert e.value.reason == "FIELD_TOO_LARGE" and e.value.metadata["field"] == "inline_remote.tp_size"
            assert time.monotonic() - started < 5
            with pytest.raises(InvalidArgument) as e:
                await pc.claim_lease(pb.ClaimLeaseRequest(request_id="r", lease_epoch=1, engine_id="D",
                                                          tp_size=1 << 24, claim_id="c" * 32))
            assert e.value.reason == "FIELD_TOO_LARGE"
            for size in (8 << 10, 4 << 20):
                with pytest.raises(InvalidArgument) as e:
                    await pc.publish_blocks("r" * size, [[1]])
                assert e.value.reason == "FIELD_TOO_LARGE" and len(str(e.value)) < 4096
                params = pb.TransferParams(remote_address=p.address, remote_request_id="q" * size, remote_epoch=1)
                with pytest.raises(InvalidArgument) as e:
                    await dc.transfer("d" * size, params, [[1]])
                assert e.value.reason == "FIELD_TOO_LARGE"
            with pytest.raises(InvalidArgument) as e:
                await pc.publish_blocks("many", [list(range(64))] * 20_000)
            assert e.value.reason == "FIELD_TOO_LARGE"
            async with grpc.aio.insecure_channel(p.address) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert (await pc.get_info()).live_leases == 0
            stitched = (await pc.publish_blocks("stitched", [[1]])).params
            stitched.remote_epoch += 1  # contradicts remote_servers[0].epoch
            with pytest.raises(InvalidArgument) as e:
                await dc.transfer("d-stitched", stitched, [[2]])
            assert e.value.reason == "PARAMS_INCONSISTENT"


async def test_random_cancellations_never_write_after_settled():
    """Item 5: after WaitTransfer says settled, nothing writes into the request's blocks."""
    with servers(1, 1, BIG) as (p, d):
        async with session(p, d) as s:
            pm, dm = s.pe.mem[0], s.de.mem[0]
            stamp(pm, list(range(64)), 7)
            rng = random.Random(5)
            late_writes = 0
            states = []
            for trial in range(30):
                dst = list(range(100, 164))
                dm.buf[:] = 0xAB
                pub = await s.pc.publish_blocks(f"c{trial}", [list(range(64))])
                call = asyncio.ensure_future(s.dc.transfer(f"dc{trial}", pub.params, [dst], timeout_s=60))
                await asyncio.sleep(rng.uniform(0, 0.04))
                call.cancel()
                try:
                    await call
                    states.append("done")
                    continue
                except (asyncio.CancelledError, KvsvcError):
                    pass
                settled = await s.dc.wait_transfer(f"dc{trial}", wait_ms=30_000)
                assert settled.state != pb.TRANSFER_STATE_RUNNING
                if settled.state == pb.TRANSFER_STATE_UNKNOWN:
                    # The Transfer never reached D, so nobody claimed P's lease: the engine, which
                    # holds the params, lets it go with the lease token.
                    answers = await abort_published(pub.params, engine_id="e2e-decode")
                    assert set(answers.values()) <= {"LEASE_STATE_ABORTED", "LEASE_STATE_UNKNOWN"}, answers
                states.append(pb.TransferState.Name(settled.state))
                snapshot = bytes(dm.buf)
                await asyncio.sleep(0.1)
                late_writes += bytes(dm.buf) != snapshot
            assert late_writes == 0, f"{late_writes} transfers wrote after they were reported settled"
            assert "TRANSFER_STATE_FAILED" in states
            for _ in range(50):  # every cancelled claim was aborted at P
                if (await s.pc.get_info()).live_leases == 0:
                    break
                await asyncio.sleep(0.1)
            assert (await s.pc.get_info()).live_leases == 0


async def test_wait_transfer_fences_unknown_ids():
    """Item 5: asking about an id first makes a Transfer with it that arrives later harmless."""
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            assert (await s.dc.wait_transfer("late", wait_ms=0)).state == pb.TRANSFER_STATE_UNKNOWN
            pub = await s.pc.publish_blocks("late-p", [[1]])
            with pytest.raises(FailedPrecondition) as e:
                await s.dc.transfer("late", pub.params, [[2]])
            assert e.value.reason == "TRANSFER_FENCED"
            ok = await s.dc.transfer("fresh", pub.params, [[2]])
            assert (await s.dc.wait_transfer("fresh", wait_ms=0)).result == ok
            with pytest.raises(KvsvcError) as e:
                await s.dc.transfer("fresh", pub.params, [[3]])  # the same id asking something else
            assert e.value.code is ErrorCode.ALREADY_EXISTS and e.value.reason == "TRANSFER_EXISTS"


async def test_a_request_id_alone_grants_nothing():
    """Item 6 (plaintext): aborting or claiming someone's lease needs its token; claims need their owner."""
    with servers(1, 1, SMALL) as (p, d):
        async with session(p, d) as s:
            pub = await s.pc.publish_blocks("victim", [[1]])
            epoch = pub.params.remote_epoch
            with pytest.raises(PermissionDenied) as e:
                await s.pc.notify(pb.NotifyRequest(request_id="victim", kind=pb.NOTIFY_KIND_ABORTED, engine_id="x",
                                                   tp_size=1, lease_epoch=epoch))
            assert e.value.reason == "LEASE_TOKEN_MISMATCH"
            with pytest.raises(PermissionDenied):
                await s.pc.claim_lease(pb.ClaimLeaseRequest(request_id="victim", lease_epoch=epoch, engine_id="x",
                                                            tp_size=1, claim_id="z" * 32))
            mine = pb.ClaimLeaseRequest(request_id="victim", lease_epoch=epoch, engine_id="D", tp_size=1,
                                        lease_token=pub.params.lease_token, claim_id="m" * 32)
            await s.pc.claim_lease(mine)
            # Another holder of the params (a second D) can neither claim nor abort the owned lease.
            with pytest.raises(FailedPrecondition) as e:
                await s.dc.transfer("d-victim", pub.params, [[2]])
            assert e.value.reason == "LEASE_CLAIMED"
            with pytest.raises(PermissionDenied) as e:
                await s.pc.notify(pb.NotifyRequest(request_id="victim", kind=pb.NOTIFY_KIND_ABORTED, engine_id="D",
                                                   tp_size=1, lease_epoch=epoch, lease_token=pub.params.lease_token))
            assert e.value.reason == "LEASE_NOT_OWNER"
            assert await abort_published(pub.params) == {p.address: "LEASE_NOT_OWNER"}  # claimed: not the router's
            done = await s.pc.notify(pb.NotifyRequest(request_id="victim", kind=pb.NOTIFY_KIND_ABORTED, engine_id="D",
                                                      tp_size=1, lease_epoch=epoch, claim_id="m" * 32))
            assert done.state == pb.LEASE_STATE_ABORTED
            given_up = await s.pc.publish_blocks("given-up", [[3]])  # the router gives up before D starts
            assert await abort_published(given_up.params) == {p.address: "LEASE_STATE_ABORTED"}
            assert (await s.pc.get_info()).live_leases == 0


@pytest.mark.parametrize("timeout_s", [0.5, 1.0, 1.5])
async def test_a_stalled_prefill_still_gets_a_typed_answer_by_its_deadline(timeout_s):
    """Round three, 13: P's server stalls after publishing -- its memory still there to be
    read, but it answers no lease call -- so D's READs end but P never answers the claim;
    deadlines under ~2 s got a bare DEADLINE_EXCEEDED from gRPC, with no word on whether the
    blocks were settled. Now D answers by the transfer's own deadline, on its own: typed,
    with a TransferFailure (remote_notified false).

    P is stalled in process (its lease calls are taken and never answered): stopping the
    whole process (SIGSTOP), as this test once did, now and then also stalled the READ itself
    (UCX waited on P), and D then rightly held its answer until the READ ended. The transfer
    goes on a TransferStream with its deadline in the call (timeout_ms), and the answer is
    read with room to spare: what is checked is that D answers without P, not a race
    between D's answer and a caller's clock on the same deadline."""
    async with in_process_pair("stall") as (p, d), engines(p, d) as (pc, dc, _pe, _de):
        pub = await pc.publish_blocks("stalled", [[1]])
        never = asyncio.Event()

        async def unanswered() -> pb.LeaseAnswer:
            await never.wait()
            raise AssertionError("a stalled P answered")

        answers = p.servicer.lease_answers
        answers.answer = lambda call, names: unanswered()  # every lease call taken, none answered
        stream = dc.channel.stream_stream(
            "/kvsvc.v1.KvTransferService/TransferStream", request_serializer=pb.TransferStreamRequest.SerializeToString,
            response_deserializer=pb.TransferStreamResponse.FromString)()
        try:
            req = pb.TransferRequest(request_id="d-stalled", params=pub.params,
                                     local_block_ids_per_group=[pb.BlockIds(block_ids=[3])])
            await stream.write(pb.TransferStreamRequest(transfers=[pb.TransferCall(
                request=req, timeout_ms=int(timeout_s * 1000))]))
            # P never answers: D must, on its own. Waiting for P's answer to its abort (the old
            # way) took ABORT_TIMEOUT_S past the deadline; half of that is a bound no
            # scheduling delay comes near, and D's answer is due a fifth before the deadline.
            resp = await asyncio.wait_for(stream.read(), timeout_s + ABORT_TIMEOUT_S / 2)
            (answer,) = resp.answers
            assert answer.WhichOneof("result") == "error_status", answer
            error = error_from_status(status_pb2.Status.FromString(answer.error_status))
            failure = [x for x in error.details if isinstance(x, pb.TransferFailure)]
            assert failure and not failure[0].remote_notified, (error.code, error.reason, error.message)
            assert (await dc.wait_transfer("d-stalled", wait_ms=0)).state == pb.TRANSFER_STATE_FAILED
        finally:
            stream.cancel()
            del answers.answer  # P answers again
        # P, awake again, frees the lease when told (D's abort was never answered).
        assert await abort_published(pub.params) == {f"127.0.0.1:{p.port}": "LEASE_STATE_ABORTED"}


async def _fds_settle(pid: int, want: int, timeout_s: float = 5.0) -> int:
    """D's fd count once it is back to want, or what it is after timeout_s (UCX closes an
    endpoint to a gone peer within a progress beat, about a second)."""
    end = time.monotonic() + timeout_s
    while fds(pid) > want and time.monotonic() < end:
        await asyncio.sleep(0.1)
    return fds(pid)


async def test_file_descriptors_stay_flat_over_prefill_restarts():
    """Round three, 6: D kept ~2 fds per P restart (its copy lanes' UCX connections to the
    old P, never progressed to their close: CLOSE-WAIT). Five graceful restarts and five
    kill -9 rounds of P at the same address, a transfer through each new P: D ends where it
    started."""
    d = start_server(engine_id="fd-d", role="decode", tp_size=1, layout=SMALL)
    p = start_server(engine_id="fd-p", role="prefill", tp_size=1, layout=SMALL)
    address = p.address
    try:
        async with AsyncClient(d.address) as dc:
            async def through_new_p(i: int) -> None:
                async with AsyncClient(address, ClientOptions(retries=0)) as pc:
                    pub = await pc.publish_blocks(f"r{i}", [[1]])
                await dc.transfer(f"d-r{i}", pub.params, [[2]])

            await through_new_p(0)
            base = fds(d.proc.pid)
            counts = []
            for i in range(10):
                if i >= 5:
                    p.kill()
                p.stop()
                p = start_server(engine_id="fd-p", role="prefill", tp_size=1, layout=SMALL, listen=address)
                await through_new_p(i + 1)
                counts.append(await _fds_settle(d.proc.pid, base) - base)
            assert counts == [0] * 10, f"D's file descriptors after each restart, over {base}: {counts}"
    finally:
        p.stop()
        d.stop()


async def test_prefill_killed_mid_transfer_is_peer_unavailable():
    """Item 7: a P that dies while D reads is PEER_UNAVAILABLE (retryable), never INTERNAL."""
    reasons = []
    for trial in range(3):
        p = start_server(engine_id="kill-p", role="prefill", tp_size=1, layout=BIG)
        d = start_server(engine_id="kill-d", role="decode", tp_size=1, layout=BIG)
        try:
            async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
                warm = await pc.publish_blocks("warm", [[1]])
                await dc.transfer("d-warm", warm.params, [[2]])
                pub = await pc.publish_blocks("big", [list(range(128))])
                call = asyncio.ensure_future(dc.transfer("d-big", pub.params, [list(range(128))], timeout_s=60))
                await asyncio.sleep(0.005 * trial)
                p.kill()
                try:
                    await call
                    reasons.append("OK")  # finished before the kill: legitimate
                except KvsvcError as e:
                    assert (e.code, e.reason) == (ErrorCode.UNAVAILABLE, "PEER_UNAVAILABLE"), e
                    failure = [x for x in e.details if isinstance(x, pb.TransferFailure)]
                    assert failure and not failure[0].valid_local_block_ids_per_group
                    reasons.append(e.reason)
                assert (await dc.get_info()).engine_id == "kill-d"
        finally:
            assert d.stop() == 0
            p.stop()
    assert "PEER_UNAVAILABLE" in reasons


async def test_malformed_bytes_are_invalid_argument():
    """Item 7: bytes that are not the request message get MALFORMED_REQUEST, not UNKNOWN and a traceback."""
    with servers(1, 1, SMALL) as (p, _d):
        async with grpc.aio.insecure_channel(p.address) as ch:
            for method in ("GetInfo", "PublishBlocks", "Notify", "Transfer", "WaitTransfer"):
                call = ch.unary_unary(f"/kvsvc.v1.KvTransferService/{method}")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"\xff\xff\xff\xff\x0f", timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "MALFORMED_REQUEST" in e.value.details()
    assert not any("Traceback" in line for line in p.output)
    assert any("PLAINTEXT" in line and "no authentication" in line for line in p.output), "plaintext says so"


async def test_sigterm_drains_claimed_leases_first():
    """Item 7: SIGTERM on P: NOT_SERVING, no new publishes, claimed leases finish, then exit."""
    p = start_server(engine_id="drain-p", role="prefill", tp_size=1, layout=SMALL)
    try:
        async with AsyncClient(p.address, ClientOptions(retries=0)) as pc:
            pub = await pc.publish_blocks("held", [[1]])
            claim = pb.ClaimLeaseRequest(request_id="held", lease_epoch=pub.params.remote_epoch, engine_id="D",
                                         tp_size=1, lease_token=pub.params.lease_token, claim_id="k" * 32)
            await pc.claim_lease(claim)
            p.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert p.proc.poll() is None, "P must wait for the claimed lease"
            with pytest.raises(Unavailable) as e:
                await pc.publish_blocks("new", [[2]])
            assert e.value.reason == "SHUTTING_DOWN"
            async with grpc.aio.insecure_channel(p.address) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await pc.notify(pb.NotifyRequest(request_id="held", kind=pb.NOTIFY_KIND_CONSUMED, engine_id="D",
                                             tp_size=1, done_ranks=[0], lease_epoch=pub.params.remote_epoch,
                                             claim_id="k" * 32))
        assert p.proc.wait(15) == 0
    finally:
        p.stop()


def _ucx_logs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"kvsvc-ucx-{pid}-*"))


def test_killed_servers_leave_no_ucx_logs():
    """Item 7: a server killed with -9 cannot clean up; the next one to start removes its log."""
    victim = start_server(engine_id="log-victim", role="both", tp_size=1, layout=SMALL)
    victim.kill()
    victim.stop()  # only closes its pipes: it is dead already
    (log_dir,) = _ucx_logs(victim.proc.pid)
    assert log_dir.is_dir() and stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    nxt = start_server(engine_id="log-next", role="both", tp_size=1, layout=SMALL)
    try:
        assert not log_dir.exists()
    finally:
        nxt.stop()
    assert not _ucx_logs(nxt.proc.pid), "a server that stops removes its own log"


def test_a_planted_link_at_the_ucx_log_path_is_never_written_through(tmp_path):
    """Round three, 2: the UCX log's name was predictable (<tmp>/kvsvc-ucx-<pid>.log), so a
    local user could plant a link there and have the server overwrite its target. Links
    planted at every name the server could use, old and new, are left as they are, and so
    are their targets."""
    target = tmp_path / "victim-file"
    target.write_text("precious")
    planted: list[Path] = []
    root = Path(tempfile.gettempdir())
    pid_guess = os.getpid() + 1
    for pid in range(pid_guess, pid_guess + 64):  # the next pids: the server's is among them
        for name in (f"kvsvc-ucx-{pid}.log", f"kvsvc-ucx-{pid}-planted"):
            link = root / name
            if not link.exists() and not link.is_symlink():
                link.symlink_to(target if name.endswith(".log") else tmp_path)
                planted.append(link)
    try:
        sp = start_server(engine_id="log-link", role="both", tp_size=1, layout=SMALL)
        try:
            assert target.read_text() == "precious", "the server wrote through a planted link"
            (own,) = [p for p in _ucx_logs(sp.proc.pid) if not p.is_symlink()]
            assert own.is_dir() and not own.is_symlink() and stat.S_IMODE(own.lstat().st_mode) == 0o700
        finally:
            assert sp.stop() == 0
        assert target.read_text() == "precious"
        assert list(tmp_path.iterdir()) == [target], "nothing was written through a planted directory link"
        assert all(link.is_symlink() for link in planted), "a planted link was removed or replaced"
    finally:
        for link in planted:
            link.unlink(missing_ok=True)


async def test_decode_engine_split_over_two_servers_claims_disjoint_ranks():
    """Ownership per D rank: two D servers of one engine hold one lease together."""
    p = start_server(engine_id="own-p", role="prefill", tp_size=1, layout=SMALL)
    d0 = start_server(engine_id="own-d", role="decode", tp_size=2, ranks=[0], layout=SMALL)
    d1 = start_server(engine_id="own-d", role="decode", tp_size=2, ranks=[1], layout=SMALL)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d0.address) as c0, AsyncClient(d1.address) as c1:
            pe = await Engine.of(pc)
            pe.fill([[4, 5]])
            pub = await pc.publish_blocks("split", [[4, 5]])
            await asyncio.gather(c0.transfer("d-split", pub.params, [[1, 2]]),
                                 c1.transfer("d-split", pub.params, [[1, 2]]))
            assert await leases_drained(pc) == 0
            pe.close()
    finally:
        for sp in (d1, d0, p):
            sp.stop()
