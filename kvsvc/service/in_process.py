"""The in-process carrier: an engine's transfers to a D server embedded in its own process.

An engine worker that embeds its server (the vLLM connector) runs both on one event loop.
Over the transfer socket each transfer was serialized, framed, written, read, parsed and
answered the same way back, all on that loop; here the request goes to the server's
Decoder as a call. What a caller sees is the same as on the TransferStream: one job per
request id, retries join it, the error of a failed transfer carries TransferFailure, and a
caller that gives up (its task cancelled) gives the transfer up; settled() then returns
only once nothing of it can write into its blocks. The caller is the process that owns
the server, so no identity is checked (a remote engine's calls still go through the
servicer's checks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsvc.client.client import blocks_proto
from kvsvc.errors import KvsvcError, Unreachable
from kvsvc.v1 import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kvsvc.service.server import RunningServer


class InProcessTransfers:
    """transfer() and settled() as TransferChannel and AsyncClient offer them, as calls
    into a RunningServer of this process. Use it on the server's event loop only."""

    carrier = "in-process"

    def __init__(self, running: RunningServer) -> None:
        self._decoder = running.decoder
        self._loop = asyncio.get_running_loop()
        self._closed = False

    async def transfer(
        self, request_id: str, params: pb.TransferParams, local_block_ids_per_group: Sequence[Sequence[int]],
        *, timeout_s: float | None = None, traceparent: str = "",
    ) -> pb.TransferResponse:
        """As TransferChannel.transfer (traceparent is not needed in process: the caller's
        span, if any, is the current one)."""
        del traceparent
        if self._closed:
            raise Unreachable("the in-process carrier was closed")
        assert asyncio.get_running_loop() is self._loop, "call on the server's event loop"
        req = pb.TransferRequest(request_id=request_id, params=params,
                                 local_block_ids_per_group=blocks_proto(local_block_ids_per_group))
        return await self._decoder.transfer(req, timeout_s)

    async def settled(self, request_id: str, error: BaseException | None = None) -> None:
        """Return once the transfer request_id can no longer write into its local blocks
        (at once for an error that carries TransferFailure: it was answered after that --
        unless the failure says quarantined: READs of it may still land, and this waits
        until they ended)."""
        failure = next((d for d in getattr(error, "details", ()) if isinstance(d, pb.TransferFailure)), None)
        if isinstance(error, KvsvcError) and failure is not None and not failure.quarantined:
            return
        while not await self._decoder.given_up(request_id):
            # A retry of the same id still waits for it and it goes on: its end settles it.
            job = self._decoder.jobs.find(request_id)
            if job is None:
                return
            await asyncio.shield(job.settled.wait())

    async def abandon(self, params: pb.TransferParams) -> dict[str, str]:
        """Abort the leases of a request the engine will not load, at every P server, over the
        server's handshaken channels (Decoder.abandon); each server's answer."""
        assert asyncio.get_running_loop() is self._loop, "call on the server's event loop"
        return await self._decoder.abandon(params)

    async def close(self) -> None:
        self._closed = True
