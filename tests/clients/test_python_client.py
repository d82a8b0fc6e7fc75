"""The Python client: one method per RPC, retries on UNAVAILABLE only, errors as KvsvcError."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
from grpc_status import rpc_status

from kvsvc.client import AsyncClient, Client, ClientOptions
from kvsvc.errors import InvalidArgument, Unavailable
from kvsvc.service.errors import to_status
from kvsvc.service.server import SERVER_OPTIONS_BASE
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_every_rpc_has_a_client_method():
    service = pb.DESCRIPTOR.services_by_name["KvTransferService"]
    for method in service.methods:
        for cls in (AsyncClient, Client):
            assert callable(getattr(cls, snake(method.name), None)), (cls.__name__, method.name)


def test_client_import_is_light():
    import kvsvc.client as c

    assert set(c.__all__) == {"AsyncClient", "Client", "ClientOptions", "error_from_rpc", "params_from_json",
                              "params_to_json"}
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, kvsvc.client; print(' '.join(sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.split()
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "nixl", "numpy", "opentelemetry", "uvloop")}
    assert not heavy, heavy


def test_keepalive_within_server_permit_policy():
    server = dict(SERVER_OPTIONS_BASE)
    assert ClientOptions().keepalive_time_ms >= server["grpc.http2.min_ping_interval_without_data_ms"]


class FlakyInfo(pb_grpc.KvTransferServiceServicer):
    """Fails `failures` times, then succeeds.

    plain=True fails like an unreachable server (a bare status, no kvsvc reason); otherwise
    it answers a kvsvc error with that code (a server's answer, never retried).
    """

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, plain: bool = True) -> None:
        self.calls, self.failures, self.code, self.plain = 0, failures, code, plain
        self.published = 0

    async def _fail(self, context):
        if self.plain:
            await context.abort(self.code, f"scripted failure {self.calls}")
        from kvsvc.errors import ErrorCode, KvsvcError

        err = KvsvcError("TEST_" + self.code.name, "scripted failure", {"call": self.calls},
                         code=ErrorCode[self.code.name])
        await context.abort_with_status(rpc_status.to_status(to_status(err)))

    async def GetInfo(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            await self._fail(context)
        return pb.GetInfoResponse(engine_id="flaky")

    async def PublishBlocks(self, request, context):
        self.published += 1
        await self._fail(context)


async def serve(servicer):
    server = grpc.aio.server()
    pb_grpc.add_KvTransferServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_retries_unavailable_then_succeeds():
    servicer = FlakyInfo(failures=2)
    server, port = await serve(servicer)
    try:
        async with AsyncClient(f"127.0.0.1:{port}", ClientOptions(retries=3, backoff_s=0.001)) as c:
            assert (await c.get_info()).engine_id == "flaky"
        assert servicer.calls == 3
    finally:
        await server.stop(0)


async def test_gives_up_after_retries():
    servicer = FlakyInfo(failures=10)
    server, port = await serve(servicer)
    try:
        async with AsyncClient(f"127.0.0.1:{port}", ClientOptions(retries=2, backoff_s=0.001)) as c:
            with pytest.raises(Unavailable) as e:
                await c.get_info()
        assert servicer.calls == 3 and e.value.reason == "UNAVAILABLE" and e.value.message == "scripted failure 3"
    finally:
        await server.stop(0)


async def test_never_retries_a_servers_own_unavailable_answer_or_a_publish():
    # PEER_UNAVAILABLE, DATA_PLANE_UNAVAILABLE...: the server answered; retrying asks the same question again.
    servicer = FlakyInfo(failures=10, plain=False)
    server, port = await serve(servicer)
    try:
        async with AsyncClient(f"127.0.0.1:{port}", ClientOptions(retries=3, backoff_s=0.001)) as c:
            with pytest.raises(Unavailable) as e:
                await c.get_info()
            assert servicer.calls == 1 and e.value.reason == "TEST_UNAVAILABLE"
            servicer.plain = True
            with pytest.raises(Unavailable):
                await c.publish_blocks("r", [[1]])  # a lost answer would make a retry a second publish
            assert servicer.published == 1
    finally:
        await server.stop(0)


async def test_never_retries_other_codes():
    servicer = FlakyInfo(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT, plain=False)
    server, port = await serve(servicer)
    try:
        async with AsyncClient(f"127.0.0.1:{port}", ClientOptions(retries=3, backoff_s=0.001)) as c:
            with pytest.raises(InvalidArgument) as e:
                await c.get_info()
        assert servicer.calls == 1 and e.value.reason == "TEST_INVALID_ARGUMENT"
        assert e.value.message == "scripted failure"
    finally:
        await server.stop(0)


class SlowInfo(pb_grpc.KvTransferServiceServicer):
    async def GetInfo(self, request, context):
        await asyncio.sleep(5)
        return pb.GetInfoResponse()


async def test_deadline_maps_to_deadline_exceeded():
    from kvsvc.errors import DeadlineExceeded

    server, port = await serve(SlowInfo())
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            with pytest.raises(DeadlineExceeded):
                await c.get_info(timeout_s=0.05)
    finally:
        await server.stop(0)


def test_sync_client_against_real_server():
    import asyncio
    import threading

    from kvsvc.config import MemoryMode, load_config
    from kvsvc.service.server import create_server

    ready, box = threading.Event(), {}

    def run() -> None:
        async def main() -> None:
            running, port = await create_server(load_config(listen="127.0.0.1:0", memory=MemoryMode.NONE))
            box["port"], box["stop"] = port, asyncio.Event()
            ready.set()
            await box["stop"].wait()
            await running.stop(0)

        loop = box["loop"] = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        with Client(f"127.0.0.1:{box['port']}") as c:
            assert c.get_info().engine_id == "kvsvc-engine"
            with pytest.raises(InvalidArgument) as e:
                c.plan_transfer(pb.PlanTransferRequest())
            assert e.value.reason == "MISSING_FIELD"
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(10)


async def test_settled_waits_out_a_quarantined_transfer():
    """A failure whose TransferFailure says quarantined is not settled: settled() asks
    WaitTransfer until it is neither RUNNING nor QUARANTINED. One that is not quarantined
    needs no question."""
    from kvsvc.errors import DeadlineExceeded
    from kvsvc.v1 import kv_transfer_pb2 as pb

    async with AsyncClient("127.0.0.1:1") as client:  # never dialled: WaitTransfer is stood in for
        states = [pb.TRANSFER_STATE_QUARANTINED, pb.TRANSFER_STATE_QUARANTINED, pb.TRANSFER_STATE_FAILED]
        asked: list[str] = []

        async def wait_transfer(request_id: str, **kw) -> pb.WaitTransferResponse:
            asked.append(request_id)
            return pb.WaitTransferResponse(state=states[len(asked) - 1])

        client.wait_transfer = wait_transfer  # type: ignore[method-assign]
        quarantined = DeadlineExceeded("DEADLINE_EXCEEDED", "late", details=[pb.TransferFailure(quarantined=True)])
        assert (await client.settled("r", quarantined)).state == pb.TRANSFER_STATE_FAILED
        assert asked == ["r", "r", "r"]
        settled = DeadlineExceeded("DEADLINE_EXCEEDED", "late", details=[pb.TransferFailure()])
        assert await client.settled("s", settled) is None and asked == ["r", "r", "r"]
