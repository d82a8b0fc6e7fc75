"""A P engine over several servers: PublishBlocks fans out from the server the engine calls.

The engine calls PublishBlocks once, on any of its servers that lists the others in
`sibling_servers`. That server leases its own ranks, then asks every sibling in parallel
to lease theirs under the same lease token, and answers TransferParams naming every
server with its ranks and epoch. D then claims, reads and notifies each server for the
ranks it hosts. One RPC from the engine, one parallel hop to the siblings: a real engine
(a scheduler process in front of per-worker servers) needs no per-server bookkeeping.
If a sibling refuses or cannot be reached, the leases already made are aborted and the
publish fails with the sibling's reason.
"""

from __future__ import annotations

import asyncio
import logging

from kvsvc.client import AsyncClient
from kvsvc.errors import ErrorCode, KvsvcError, Unavailable
from kvsvc.reasons import Reason
from kvsvc.service.node import Node
from kvsvc.service.peers import peer_client_options
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


class Siblings:
    """Clients of this engine's other servers, and what was last heard of each."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._clients: dict[str, AsyncClient] = {}
        self.known: dict[str, pb.EngineServer] = {
            a: pb.EngineServer(address=a) for a in node.config.sibling_servers}

    def _client(self, address: str) -> AsyncClient:
        if address not in self._clients:
            # A sibling is the same engine: under TLS its certificate names our engine id.
            opts = peer_client_options(self._node, self._node.config.engine_id)
            self._clients[address] = AsyncClient(address, opts)
        return self._clients[address]

    async def publish(self, req: pb.PublishBlocksRequest, token: str) -> list[pb.EngineServer]:
        """Lease req on every sibling under token; the siblings' EngineServer entries."""
        fan = pb.PublishBlocksRequest(request_id=req.request_id, block_ids_per_group=req.block_ids_per_group,
                                      lease_ttl_ms=req.lease_ttl_ms, lease_token=token, num_tokens=req.num_tokens)
        addresses = list(self.known)
        answers = await asyncio.gather(*(self._client(a).publish_blocks_request(fan) for a in addresses),
                                       return_exceptions=True)
        servers, failed = [], None
        for address, answer in zip(addresses, answers, strict=True):
            if isinstance(answer, BaseException):
                failed = failed or (address, answer)
                continue
            entry = answer.params.remote_servers[0]
            self.known[address] = entry
            servers.append(entry)
        if failed is not None:
            await self.abort(req.request_id, token, servers)
            address, err = failed
            if isinstance(err, KvsvcError) and err.code is not ErrorCode.UNAVAILABLE:
                raise err
            raise Unavailable(Reason.SIBLING_UNAVAILABLE, f"sibling server {address} of this engine could not lease "
                              f"{req.request_id!r}: {err}", {"address": address}) from err
        return servers

    async def abort(self, request_id: str, token: str, servers: list[pb.EngineServer]) -> None:
        """Best effort: withdraw the sibling leases of a publish that failed elsewhere (no release events)."""
        async def one(s: pb.EngineServer) -> None:
            try:
                await self._client(s.address).notify(pb.NotifyRequest(
                    request_id=request_id, kind=pb.NOTIFY_KIND_ABORTED, engine_id=self._node.config.engine_id,
                    tp_size=self._node.config.tp_size, lease_epoch=s.epoch, lease_token=token, withdraw=True),
                    timeout_s=2.0)
            except KvsvcError:
                log.warning("could not abort %s on sibling %s", request_id, s.address)

        await asyncio.gather(*(one(s) for s in servers))

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
