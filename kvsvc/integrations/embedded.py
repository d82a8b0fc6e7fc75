"""One kvsvc server inside one engine worker (a TP rank), over that worker's KV memory: what
vLLM's connector and SGLang's backend share.

The server runs on its own event loop thread (LoopThread), the engine's KV memory
registered in place. P leases a request's blocks on it (InProcessLeases) and hears from
its lease table when D is done with them; D runs its transfers on it as in-process calls
(InProcessTransfers: no socket, no gRPC to itself), each of which ends only once nothing
of it can write into the engine's blocks any more. The methods without `_here` are called
from the engine's threads and never block them for longer than one hop to the loop,
except start() and stop(); those with `_here` run on the loop (an engine's own coroutines
there call them directly, in order with its other work).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvsvc.config import Role, ServerConfig
from kvsvc.errors import KvsvcError
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.loop import LoopThread
from kvsvc.leases.table import Lease, LeaseState
from kvsvc.service.in_process import InProcessLeases, InProcessTransfers, ReleaseCallback
from kvsvc.service.server import RunningServer, create_server
from kvsvc.v1 import kv_transfer_pb2 as pb

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 10.0


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class EmbeddedServer:
    """config: the server's (one rank: config.ranks; its layout is the description's);
    description: this rank's layout and the engine's KV memory, one buffer per region in
    region order; advertise_host: where peers reach it. on_release
    (P): every lease this server releases, once, on the loop; waiting_for (P, on the loop):
    the request ids the engine waits on, looked up after a gap in the release stream."""

    def __init__(self, config: ServerConfig, description: CacheDescription, *, advertise_host: str,
                 on_release: ReleaseCallback | None = None, waiting_for: Callable[[], Iterable[str]] = tuple,
                 log: logging.Logger | None = None, name: str = "") -> None:
        assert len(config.ranks) == 1, "an embedded server serves one rank"
        self.config = dataclasses.replace(config, engine_layout=description.layout)
        self.tp_rank = config.ranks[0]
        self.description = description
        self._advertise_host = advertise_host
        self._on_release = on_release
        self._waiting_for = waiting_for
        self._log = log or logging.getLogger("kvsvc.engine")
        self.loop = LoopThread(name or f"kvsvc-{config.role.value}-{self.tp_rank}", self._log)
        self._server: RunningServer | None = None
        self._leases: InProcessLeases | None = None  # P
        self._transfers: InProcessTransfers | None = None  # D
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # D: running transfers, on the loop
        self._given_up: set[str] = set()  # D: cancelled before their task ran
        self.address = ""
        self.epoch = 0

    # ---- life ----------------------------------------------------------------------

    def start(self) -> None:
        """Boot the server on the loop (raises what create_server raised)."""
        async def boot() -> None:
            server, port = await create_server(self.config, external_pools={self.tp_rank: self.description.buffers})
            self._server = server
            self.address, self.epoch = host_port(self._advertise_host, port), server.node.epoch
            if self.config.role in (Role.PREFILL, Role.BOTH):  # hears releases before any lease exists
                self._leases = InProcessLeases(server, self._released, self._waiting_for)
            if self.config.role in (Role.DECODE, Role.BOTH):
                self._transfers = InProcessTransfers(server)

        self.loop.run(boot(), START_TIMEOUT_S)
        self.loop.submit(self.loop.watch_stalls())

    def stop(self, grace_s: float = 5.0) -> None:
        """Give every running transfer up (each settles), then stop the server and the loop."""
        server, self._server = self._server, None
        if server is not None:
            leases, transfers, self._leases, self._transfers = self._leases, self._transfers, None, None

            async def down() -> None:
                for task in list(self._tasks.values()):
                    task.cancel()
                if transfers is not None:
                    await transfers.close()
                if leases is not None:
                    await leases.close()
                await server.stop(grace_s)

            try:
                self.loop.run(down(), 30)
            except Exception:
                self._log.warning("kvsvc: the server of rank %d did not stop cleanly", self.tp_rank, exc_info=True)
        self.loop.stop()

    @property
    def server(self) -> RunningServer:
        if self._server is None:
            raise RuntimeError("the kvsvc server is not running")
        return self._server

    @property
    def leases(self) -> InProcessLeases | None:
        """P's port (None on a decode server, or once stopped); on the loop only."""
        return self._leases

    @property
    def metrics_address(self) -> str:
        return self.server.metrics_address

    # ---- P -------------------------------------------------------------------------

    def lease(self, request_id: str, blocks: Sequence[Sequence[int]], token: str, ttl_ms: int = 0,
              num_tokens: int = 0, progressive: bool = False) -> pb.TransferParams:
        """Lease blocks (one list per group) under token on this rank's server; the params name
        this server alone (a D joins the pieces of every P rank it reads). Raises KvsvcError
        when refused. progressive: open the lease with the first chunk's blocks; commit()
        appends the rest (docs/ARCHITECTURE.md, "Progressive pull")."""
        ids = [pb.BlockIds(block_ids=group) for group in blocks]
        req = pb.PublishBlocksRequest(request_id=request_id, block_ids_per_group=ids, lease_token=token,
                                      lease_ttl_ms=ttl_ms, num_tokens=num_tokens, progressive=progressive)

        async def make() -> Lease:
            return self._require_leases().lease(req)

        lease = self.loop.run(make(), CALL_TIMEOUT_S)
        return pb.TransferParams(
            remote_address=self.address, remote_engine_id=self.config.engine_id, remote_request_id=request_id,
            remote_block_ids_per_group=ids, remote_epoch=self.epoch, remote_tp_size=self.config.tp_size,
            lease_token=token, remote_num_tokens=num_tokens, progressive=progressive,
            # The lease's serial: an engine may lease the same request id under the same token
            # again (SGLang's bootstrap room); these params can never claim that later lease.
            remote_servers=[pb.EngineServer(address=self.address, ranks=[self.tp_rank], epoch=self.epoch,
                                            lease_serial=lease.serial)])

    def commit(self, request_id: str, token: str, commit_epoch: int, blocks: Sequence[Sequence[int]],
               num_tokens: int, final: bool = False) -> None:
        """Append one chunk's blocks (one list per group) to a progressive lease made by
        lease(progressive=True), under the next commit epoch (2 after the opening). Raises
        KvsvcError when refused (LEASE_EXPIRED: D gave the request up or it expired; the
        release is reported through on_release)."""
        req = pb.CommitBlocksRequest(request_id=request_id, lease_token=token, commit_epoch=commit_epoch,
                                     block_ids_per_group=[pb.BlockIds(block_ids=group) for group in blocks],
                                     num_tokens=num_tokens, final=final)

        async def append() -> None:
            self._require_leases().commit(req)

        self.loop.run(append(), CALL_TIMEOUT_S)

    def withdraw(self, request_id: str, token: str) -> bool:
        """Take back an unclaimed lease, or a progressive one not final yet (P aborts the request). True: nobody can read the blocks
        any more (withdrawn, already released, or never made); False: D holds a claim and
        reads, and the release that ends it comes through on_release. Waits for the answer
        however long the server's loop takes (see withdraw_later)."""
        return self.withdraw_later(request_id, token).result()

    def withdraw_later(self, request_id: str, token: str) -> concurrent.futures.Future[bool]:
        """withdraw() without waiting: the future says True or False once the server's loop
        has run the withdraw. It has no timeout on purpose: a withdraw that has not run yet
        may still find D's claim, so "no answer yet" never means "gone" (the blocks are
        freed only on True)."""
        async def take_back() -> bool:
            return self._require_leases().withdraw(request_id, token)

        return self.loop.submit(take_back())

    def final_state(self, request_id: str) -> LeaseState | None:
        async def ask() -> LeaseState | None:
            return self._require_leases().final_state(request_id)

        return self.loop.run(ask(), CALL_TIMEOUT_S)

    def _require_leases(self) -> InProcessLeases:
        if self._leases is None:
            raise RuntimeError("leases are made on a running prefill server")
        return self._leases

    def _released(self, request_id: str, how: LeaseState) -> None:
        if self._on_release is not None:
            self._on_release(request_id, how)

    # ---- D -------------------------------------------------------------------------

    def transfer(self, request_id: str, params: pb.TransferParams, blocks: Sequence[Sequence[int]],
                 timeout_s: float) -> concurrent.futures.Future[pb.TransferResponse]:
        """Start reading params' blocks into this rank's blocks (one list per group); the
        future ends only once nothing of the transfer can write into them any more (also
        when cancelled)."""
        return self.loop.submit(self.transfer_here(request_id, params, [list(g) for g in blocks], timeout_s))

    async def transfer_here(self, request_id: str, params: pb.TransferParams, blocks: Sequence[Sequence[int]],
                            timeout_s: float, local_prefix_tokens: int = 0) -> pb.TransferResponse:
        """transfer() on the loop, in the caller's task (cancel(request_id) cancels that task).
        local_prefix_tokens: for progressive params, the leading tokens this engine holds
        already (TransferRequest.local_prefix_tokens); blocks are those after them."""
        if self._transfers is None:
            raise RuntimeError("transfers run on a running decode server")
        if request_id in self._given_up:  # cancelled before it started: nothing to settle
            self._given_up.discard(request_id)
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        self._tasks[request_id] = task
        transfers = self._transfers
        try:
            return await transfers.transfer(request_id, params, blocks, timeout_s=timeout_s,
                                            local_prefix_tokens=local_prefix_tokens)
        except BaseException as e:
            # The engine frees (and may reuse) the blocks once told the transfer ended: tell
            # it only when nothing of the transfer can write into them any more.
            try:
                await asyncio.shield(transfers.settled(request_id, e))
            except KvsvcError as settle_error:  # the server stops: its stop settles every read
                self._log.warning("kvsvc: could not learn whether %s settled: %s", request_id, settle_error)
            raise
        finally:
            self._tasks.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Give a running transfer up; its future ends once it settled. (Not the future's own
        cancel(): that would say it ended at once, while a READ may still write.)"""
        self.loop.loop.call_soon_threadsafe(self.cancel_here, request_id)

    def cancel_here(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
        else:  # submitted, its task not started yet
            self._given_up.add(request_id)

    async def abandon_here(self, params: pb.TransferParams) -> dict[str, str]:
        """Abort the leases of a request the engine will not load, at every P server, over the
        server's handshaken channels; each server's answer."""
        if self._transfers is None:
            raise RuntimeError("transfers run on a running decode server")
        return await self._transfers.abandon(params)
