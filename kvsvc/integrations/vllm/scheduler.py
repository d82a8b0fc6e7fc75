"""The scheduler side of the connector: which requests load remote KV, and P's leases.

P: request_finished leases the finished request's blocks on every worker's kvsvc server
(one PublishBlocks per server, the first mints the lease token, the others lease under
it), keeps the blocks (delay_free) and returns the params a router copies to D.
D: requests with kvsvc params report their prompt as loadable asynchronously; the
blocks vLLM allocates for them go to the workers in the step's metadata. Until then (a
request can wait in D's queue for a long time when its KV cache is full) their P leases
are kept alive: the metadata tells rank 0's worker when such a request arrives and when
it stops waiting, and the worker heartbeats the waiting ones on its own timer (not on
D's steps, which can take longer than a lease on a loaded host), off this thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.layout import kernel_block_ids
from kvsvc.integrations.vllm.loop import LoopThread
from kvsvc.integrations.vllm.metadata import LEASE_HEARTBEAT_S, KvsvcConnectorMetadata, Receive, ServerInfo
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("vllm.kvsvc")  # under vLLM's logger: its handlers and level apply

PUBLISH_TIMEOUT_S = 10.0
FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


class KvsvcScheduler:
    def __init__(self, *, engine_id: str, tp_size: int, dcp_size: int, is_producer: bool,
                 options: ClientOptions | None = None, lease_ttl_ms: int = 0,
                 lease_heartbeat_s: float = LEASE_HEARTBEAT_S) -> None:
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.dcp_size = dcp_size
        self.is_producer = is_producer
        self.lease_ttl_ms = lease_ttl_ms
        self._options = options
        self._servers: dict[int, ServerInfo] = {}
        self._loop: LoopThread | None = None
        self._clients: list[AsyncClient] = []
        self._meta = KvsvcConnectorMetadata()
        self._waiting: set[str] = set()  # D requests parked until their transfer ends
        # D requests with kvsvc params not yet given blocks: their P leases are heartbeated.
        self._queued: set[str] = set()
        self.lease_heartbeat_s = lease_heartbeat_s

    # ---- set-up ----------------------------------------------------------------------

    def set_servers(self, metadata: dict[int, Any]) -> None:
        self._servers = {rank: meta for rank, meta in metadata.items() if isinstance(meta, ServerInfo)}

    def _ensure_clients(self) -> list[AsyncClient]:
        if len(self._servers) != self.tp_size:
            raise RuntimeError(f"kvsvc servers known for ranks {sorted(self._servers)}, TP is {self.tp_size}")
        if self._loop is None:
            self._loop = LoopThread("kvsvc-scheduler")

            async def make() -> list[AsyncClient]:
                return [AsyncClient(self._servers[r].address, self._options) for r in range(self.tp_size)]

            self._clients = self._loop.run(make())
        return self._clients

    def shutdown(self) -> None:
        if self._loop is not None:
            clients, self._clients = self._clients, []

            async def close() -> None:
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

            self._loop.run(close(), 10)
            self._loop.stop()
            self._loop = None

    # ---- D: what to load -------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if kvparams.is_kvsvc(request.kv_transfer_params) and self.lease_heartbeat_s > 0:
            self._queued.add(request.request_id)
            self._meta.keep_alive[request.request_id] = dict(request.kv_transfer_params)

    def _stop_keeping(self, req_id: str) -> None:
        if req_id in self._queued:
            self._queued.discard(req_id)
            if self._meta.keep_alive.pop(req_id, None) is None:  # the worker heard of it: tell it
                self._meta.stop_keep_alive.add(req_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not kvparams.is_kvsvc(params):
            return 0, False
        # Every prompt token P computed: D recomputes nothing of the prompt but what
        # vLLM itself decides to (it always computes the last token for its logits).
        total = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        count = total - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not kvparams.is_kvsvc(params):
            return
        self._stop_keeping(request.request_id)  # its transfer claims (and extends) the lease itself
        # Only the blocks D does not hold already (a prefix hit keeps its hashed blocks).
        local = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else [[] for _ in blocks.blocks]
        awaiting = num_external_tokens > 0
        self._meta.receive[request.request_id] = Receive(kvparams.block_lists(local), dict(params), awaiting)
        if awaiting:
            self._waiting.add(request.request_id)
        params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: Any) -> KvsvcConnectorMetadata:
        meta, self._meta = self._meta, KvsvcConnectorMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._waiting.discard(req_id)

    # ---- both: a finished request ----------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._stop_keeping(request.request_id)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if kvparams.is_kvsvc(params):
            # D never scheduled it (aborted while waiting): P's lease must not wait out its TTL.
            self._meta.abandon[request.request_id] = dict(params)
            params["do_remote_prefill"] = False
            return False, None
        if request.request_id in self._waiting:
            self._meta.cancel.add(request.request_id)  # vLLM keeps the blocks until the transfer ends
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status.name not in FINISHED_OK or not any(len(g) for g in block_ids):
            return False, None
        try:
            params = self._publish(request, block_ids)
            self._meta.delayed.add(request.request_id)
            return True, params
        except Exception as e:  # D then prefills itself; the blocks are freed now
            log.warning("kvsvc: could not lease %s for decode: %s", request.request_id, e)
            return False, None

    def _publish(self, request: Any, block_ids: Any) -> dict[str, Any]:
        """Lease the blocks on every worker's server; the params name them all."""
        clients = self._ensure_clients()
        assert self._loop is not None
        per_logical = {info.blocks_per_logical for info in self._servers.values()}
        if len(per_logical) != 1:
            raise RuntimeError(f"workers split vLLM's blocks differently: {sorted(per_logical)}")
        ids = [pb.BlockIds(block_ids=g) for g in kernel_block_ids(block_ids, per_logical.pop())]
        num_tokens = int(request.num_computed_tokens)
        first = pb.PublishBlocksRequest(request_id=request.request_id, block_ids_per_group=ids,
                                        lease_ttl_ms=self.lease_ttl_ms, num_tokens=num_tokens)

        async def publish_all() -> pb.TransferParams:
            resp = await clients[0].publish_blocks_request(first, timeout_s=PUBLISH_TIMEOUT_S)
            params = resp.params
            rest = pb.PublishBlocksRequest()
            rest.CopyFrom(first)
            rest.lease_token = params.lease_token
            answers = await asyncio.gather(*(c.publish_blocks_request(rest, timeout_s=PUBLISH_TIMEOUT_S)
                                             for c in clients[1:]), return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:  # the answers that came back say each leasing server's epoch
                leased = [(clients[0], params.remote_epoch)] + [
                    (c, a.params.remote_epoch) for c, a in zip(clients[1:], answers, strict=True)
                    if isinstance(a, pb.PublishBlocksResponse)]
                await self._withdraw(params, leased)
                raise failed[0]
            servers = [params.remote_servers[0]] if params.remote_servers else [
                pb.EngineServer(address=params.remote_address, ranks=[0], epoch=params.remote_epoch)]
            for a in answers:
                assert isinstance(a, pb.PublishBlocksResponse)
                servers.extend(a.params.remote_servers)
            del params.remote_servers[:]
            params.remote_servers.extend(servers)
            return params

        params = self._loop.run(publish_all(), PUBLISH_TIMEOUT_S * 2)
        log.debug("kvsvc: leased %s (%d tokens) on %d servers", request.request_id, num_tokens,
                  len(params.remote_servers))
        return kvparams.to_vllm(params, num_tokens=num_tokens, tp_size=self.tp_size, dcp_size=self.dcp_size)

    async def _withdraw(self, params: pb.TransferParams, leased: list[tuple[AsyncClient, int]]) -> None:
        """Take back the leases a half-done publish made (no release event: nothing was handed out)."""
        for c, epoch in leased:
            try:
                await c.notify(pb.NotifyRequest(request_id=params.remote_request_id, kind=pb.NOTIFY_KIND_ABORTED,
                                                engine_id=self.engine_id, tp_size=self.tp_size, lease_epoch=epoch,
                                                lease_token=params.lease_token, withdraw=True))
            except Exception as e:
                log.warning("kvsvc: could not withdraw %s: %s", params.remote_request_id, e)
