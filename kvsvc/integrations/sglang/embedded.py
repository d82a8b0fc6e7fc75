"""One kvsvc server inside one SGLang TP worker, over that worker's KV pools, and the calls
SGLang's backend makes on it from its own threads.

The server runs on its own event loop thread (LoopThread), with SGLang's KV memory
registered in place. P leases a request's pages on it and learns from its lease table when
D is done with them; D runs its transfers on it as in-process calls (no socket, no gRPC to
itself). Every method here is called from SGLang's threads and never blocks them for
longer than one hop to the loop, except start() and stop().
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvsvc.config import Role, load_config
from kvsvc.errors import KvsvcError
from kvsvc.integrations.loop import LoopThread
from kvsvc.integrations.sglang.layout import SGLangCacheDescription
from kvsvc.leases.table import LeaseState
from kvsvc.service.in_process import InProcessLeases, InProcessTransfers
from kvsvc.service.server import RunningServer, create_server
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("sglang.kvsvc")

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 10.0

# on_release(request_id, how the lease ended): called on the server's loop thread.
ReleaseCallback = Callable[[str, LeaseState], None]


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class EmbeddedServer:
    def __init__(self, *, engine_id: str, role: Role, tp_rank: int, tp_size: int,
                 description: SGLangCacheDescription, host: str, config_path: str | None = None,
                 on_release: ReleaseCallback | None = None) -> None:
        self.engine_id, self.role, self.tp_rank, self.tp_size = engine_id, role, tp_rank, tp_size
        self._description = description
        self._host = host
        self._config_path = config_path
        self._on_release = on_release
        self._loop = LoopThread(f"kvsvc-sglang-{role.value}-{tp_rank}", log)
        self._server: RunningServer | None = None
        self._leases: InProcessLeases | None = None  # P
        self._transfers: InProcessTransfers | None = None  # D
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # D: running transfers, on the loop
        self._given_up: set[str] = set()  # D: cancelled before their task ran
        self.address = ""
        self.epoch = 0

    # ---- life ----------------------------------------------------------------------

    def start(self) -> None:
        config = load_config(self._config_path, listen=host_port(self._host, 0), engine_id=self.engine_id,
                             role=self.role, tp_size=self.tp_size, ranks=[self.tp_rank],
                             layout_table=self._description.table)
        host, _, port = config.metrics_listen.rpartition(":")
        if port.isdigit() and int(port):  # one engine, several workers: a fixed port is the first rank's
            config = dataclasses.replace(config, metrics_listen=f"{host}:{int(port) + self.tp_rank}")

        async def boot() -> None:
            server, port = await create_server(config, external_pools={self.tp_rank: self._description.buffers})
            self._server = server
            self.address, self.epoch = host_port(self._host, port), server.node.epoch
            if self.role is Role.PREFILL:  # hears releases before any lease can exist
                self._leases = InProcessLeases(server, self._released)
            else:
                self._transfers = InProcessTransfers(server)

        self._loop.run(boot(), START_TIMEOUT_S)
        self._loop.submit(self._loop.watch_stalls())
        metrics = self.server.metrics_address
        log.info("kvsvc: SGLang %s rank %d serves its KV at %s%s", self.role.value, self.tp_rank, self.address,
                 f" (metrics at http://{metrics}/metrics)" if metrics else "")

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            async def down() -> None:
                if self._leases is not None:
                    await self._leases.close()
                for task in list(self._tasks.values()):
                    task.cancel()
                if self._transfers is not None:
                    await self._transfers.close()
                await server.stop(5)

            try:
                self._loop.run(down(), 30)
            except Exception:
                log.warning("kvsvc: the server of rank %d did not stop cleanly", self.tp_rank, exc_info=True)
        self._loop.stop()

    @property
    def server(self) -> RunningServer:
        if self._server is None:
            raise RuntimeError("the kvsvc server is not running")
        return self._server

    # ---- P -------------------------------------------------------------------------

    def lease(self, request_id: str, pages: Sequence[Sequence[int]], token: str, ttl_ms: int = 0) -> pb.TransferParams:
        """Lease pages (one list per group) under token on this rank's server; the params name
        this server alone (D joins the pieces of every P rank it reads). Raises KvsvcError
        when refused."""
        ids = [pb.BlockIds(block_ids=group) for group in pages]
        req = pb.PublishBlocksRequest(request_id=request_id, block_ids_per_group=ids,
                                      lease_token=token, lease_ttl_ms=ttl_ms)

        async def make() -> pb.TransferParams:
            assert self._leases is not None, "leases are made on a prefill server"
            lease = self._leases.lease(req)
            return pb.TransferParams(
                remote_address=self.address, remote_engine_id=self.engine_id, remote_request_id=request_id,
                remote_block_ids_per_group=ids, remote_epoch=self.epoch,
                remote_tp_size=self.tp_size, lease_token=token,
                # The lease's serial: SGLang's token and request id come from its bootstrap room,
                # which may be used again; a transfer with this lease's params can then never
                # claim the later lease of that room.
                remote_servers=[pb.EngineServer(address=self.address, ranks=[self.tp_rank], epoch=self.epoch,
                                                lease_serial=lease.serial)])

        return self._loop.run(make(), CALL_TIMEOUT_S)

    def withdraw(self, request_id: str, token: str) -> bool:
        """Take back an unclaimed lease (P aborts the request). True: nobody can read the pages
        any more (withdrawn, already released, or never made); False: D holds a claim and
        reads, and the release that ends it comes through on_release. Waits for the answer
        however long the server's loop takes (see withdraw_later)."""
        return self.withdraw_later(request_id, token).result()

    def withdraw_later(self, request_id: str, token: str) -> concurrent.futures.Future[bool]:
        """withdraw() without waiting: the future says True or False once the server's loop
        has run the withdraw. It has no timeout on purpose: a withdraw that has not run yet
        may still find D's claim, so "no answer yet" never means "gone" (the pages are
        freed only on True)."""
        async def take_back() -> bool:
            assert self._leases is not None, "leases are made on a prefill server"
            return self._leases.withdraw(request_id, token)

        return self._loop.submit(take_back())

    def _released(self, request_id: str, how: LeaseState) -> None:
        if self._on_release is not None:
            self._on_release(request_id, how)

    def final_state(self, request_id: str) -> LeaseState | None:
        return self._loop.run(self._final_state(request_id), CALL_TIMEOUT_S)

    async def _final_state(self, request_id: str) -> LeaseState | None:
        assert self._leases is not None, "leases are made on a prefill server"
        return self._leases.final_state(request_id)

    # ---- D -------------------------------------------------------------------------

    def transfer(self, request_id: str, params: pb.TransferParams, pages: Sequence[Sequence[int]],
                 timeout_s: float) -> concurrent.futures.Future[pb.TransferResponse]:
        """Start reading params' pages into this rank's pages (one list per group); the future
        ends only once nothing of the transfer can write into them any more (also when
        cancelled)."""
        return self._loop.submit(self._transfer(request_id, params, [list(g) for g in pages], timeout_s))

    async def _transfer(self, request_id: str, params: pb.TransferParams, pages: list[list[int]],
                        timeout_s: float) -> pb.TransferResponse:
        assert self._transfers is not None, "transfers run on a decode server"
        if request_id in self._given_up:  # cancelled before it started: nothing to settle
            self._given_up.discard(request_id)
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        self._tasks[request_id] = task
        try:
            return await self._transfers.transfer(request_id, params, pages, timeout_s=timeout_s)
        except BaseException as e:
            try:
                await asyncio.shield(self._transfers.settled(request_id, e))
            except KvsvcError as settle_error:  # the server stops: its stop settles every read
                log.warning("kvsvc: could not learn whether %s settled: %s", request_id, settle_error)
            raise
        finally:
            self._tasks.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Give a running transfer up; its future ends once it settled."""
        def cancel_here() -> None:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
            else:  # submitted, its task not started yet
                self._given_up.add(request_id)

        self._loop.loop.call_soon_threadsafe(cancel_here)
