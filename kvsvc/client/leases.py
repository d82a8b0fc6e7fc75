"""Give P's blocks back from wherever the params are held (a router, a D engine)."""

from __future__ import annotations

import asyncio

from kvsvc.client.client import AsyncClient, ClientOptions
from kvsvc.errors import KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb


async def abort_published(params: pb.TransferParams, *, engine_id: str = "router",
                          options: ClientOptions | None = None) -> dict[str, str]:
    """Abort the request's lease on every P server the params name, with the lease token.

    For a request that will not be transferred (the router gave up, or the D engine's
    Transfer never reached its server: WaitTransfer said UNKNOWN). A lease that a D
    transfer has claimed is not touched (LEASE_NOT_OWNER): that transfer frees it.
    Returns each server's answer: a LeaseState name, or the error reason.
    """
    servers = list(params.remote_servers) or [pb.EngineServer(address=params.remote_address,
                                                               epoch=params.remote_epoch)]

    async def one(s: pb.EngineServer) -> tuple[str, str]:
        req = pb.NotifyRequest(request_id=params.remote_request_id, kind=pb.NOTIFY_KIND_ABORTED,
                               engine_id=engine_id, tp_size=1, lease_epoch=s.epoch, lease_token=params.lease_token)
        try:
            async with AsyncClient(s.address, options) as client:
                return s.address, pb.LeaseState.Name((await client.notify(req)).state)
        except KvsvcError as e:
            return s.address, e.reason

    return dict(await asyncio.gather(*(one(s) for s in servers)))
