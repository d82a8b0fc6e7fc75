"""Act on P's leases from wherever the params are held (a router, a D engine): give the
blocks back, or keep them while the request waits."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping

from kvsvc.client.client import AsyncClient, ClientOptions
from kvsvc.errors import KvsvcError
from kvsvc.reasons import ErrorCode, Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

LEASE_NOT_YET_MADE = "LEASE_NOT_YET_MADE"  # heartbeat answer: params with lease_pending, lease not made yet
# A heartbeat that ended with one of these codes said nothing of the lease (P not reached,
# stalled past the call's timeout, busy): the next round tries again.
_TRANSIENT_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.RESOURCE_EXHAUSTED,
                              ErrorCode.CANCELLED, ErrorCode.INTERNAL})
HEARTBEATS_IN_FLIGHT = 64  # per P server: a D queue of thousands must not open thousands of calls at once


def servers_of(params: pb.TransferParams) -> list[pb.EngineServer]:
    """The P servers holding the request's lease (params of one server name it by address alone)."""
    return list(params.remote_servers) or [pb.EngineServer(address=params.remote_address, epoch=params.remote_epoch)]


def _notify(params: pb.TransferParams, kind: int, server: pb.EngineServer,
            engine_id: str) -> pb.NotifyRequest:
    return pb.NotifyRequest(request_id=params.remote_request_id, kind=kind,  # type: ignore[arg-type]
                            engine_id=engine_id, tp_size=1,
                            lease_epoch=server.epoch, lease_token=params.lease_token)


async def abort_published(params: pb.TransferParams, *, engine_id: str = "router",
                          options: ClientOptions | None = None,
                          channels: Mapping[str, AsyncClient] | None = None) -> dict[str, str]:
    """Abort the request's lease on every P server the params name, with the lease token.

    For a request that will not be transferred (the router gave up, or the D engine's
    Transfer never reached its server: WaitTransfer said UNKNOWN). A lease that a D
    transfer has claimed is not touched (LEASE_NOT_OWNER): that transfer frees it.
    channels: open clients by address (a D server's handshaken peers) used before dialling
    anew; one that fails (closed meanwhile) is not trusted with the answer: the server is
    dialled. Returns each server's answer: a LeaseState name, or the error reason.
    """
    timeout_s = options.timeout_s if options is not None else None

    async def one(s: pb.EngineServer) -> tuple[str, str]:
        open_client = (channels or {}).get(s.address)
        if open_client is not None:
            try:
                return s.address, pb.LeaseState.Name((await open_client.notify(
                    _notify(params, pb.NOTIFY_KIND_ABORTED, s, engine_id), timeout_s=timeout_s)).state)
            except KvsvcError:
                pass
        try:
            async with AsyncClient(s.address, options) as client:
                return s.address, pb.LeaseState.Name((await client.notify(
                    _notify(params, pb.NOTIFY_KIND_ABORTED, s, engine_id))).state)
        except KvsvcError as e:
            return s.address, e.reason

    return dict(await asyncio.gather(*(one(s) for s in servers_of(params))))


def heartbeat_is_transient(answer: str) -> bool:
    """Whether a heartbeat answer (heartbeat_published's) says nothing final of the lease:
    an error whose code means P was not reached or did not answer in time. A lease state,
    LEASE_NOT_YET_MADE and a refusal (LEASE_EXPIRED, LEASE_TOKEN_MISMATCH, ...) are P's word."""
    try:
        reason = Reason(answer)
    except ValueError:
        return False  # a lease state's name or LEASE_NOT_YET_MADE
    return reason.code in _TRANSIENT_CODES


async def heartbeat_published(waiting: Mapping[str, pb.TransferParams], *, engine_id: str,
                              options: ClientOptions | None = None, timeout_s: float = 5.0,
                              channels: dict[str, AsyncClient] | None = None) -> dict[str, dict[str, str]]:
    """Keep the leases of requests that wait (in D's queue) alive: a HEARTBEAT with each
    lease token to every P server holding one, which extends an unclaimed lease by its
    server's default TTL. One channel per P server for the whole batch; with `channels`
    (address -> client, owned by the caller) the channels are kept for the next round,
    which then costs its calls alone.

    Returns, per request, each server's answer: a LeaseState name (OFFERED: kept; a final
    state: too late, the request will fail its load), LEASE_NOT_YET_MADE (params with
    lease_pending whose lease P has not made yet: nothing to keep so far) or the error reason.
    """
    by_server: dict[str, list[tuple[str, pb.TransferParams, pb.EngineServer]]] = defaultdict(list)
    for req_id, params in waiting.items():
        for s in servers_of(params):
            by_server[s.address].append((req_id, params, s))
    answers: dict[str, dict[str, str]] = defaultdict(dict)

    async def to_server(address: str, items: list[tuple[str, pb.TransferParams, pb.EngineServer]]) -> None:
        gate = asyncio.Semaphore(HEARTBEATS_IN_FLIGHT)

        async def one(client: AsyncClient, req_id: str, params: pb.TransferParams, s: pb.EngineServer) -> None:
            async with gate:
                try:
                    resp = await client.notify(_notify(params, pb.NOTIFY_KIND_HEARTBEAT, s, engine_id),
                                               timeout_s=timeout_s)
                    pending = params.lease_pending and resp.state == pb.LEASE_STATE_UNKNOWN
                    answers[req_id][address] = LEASE_NOT_YET_MADE if pending else pb.LeaseState.Name(resp.state)
                except KvsvcError as e:
                    answers[req_id][address] = e.reason

        try:
            if channels is None:
                async with AsyncClient(address, options) as client:
                    await asyncio.gather(*(one(client, *item) for item in items))
                return
            if address not in channels:
                channels[address] = AsyncClient(address, options)
            await asyncio.gather(*(one(channels[address], *item) for item in items))
        except KvsvcError as e:  # the channel itself (TLS files, a bad address)
            for req_id, _, _ in items:
                answers[req_id].setdefault(address, e.reason)

    await asyncio.gather(*(to_server(a, items) for a, items in by_server.items()))
    return dict(answers)
