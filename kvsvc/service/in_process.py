"""The in-process ports: what an engine asks of a server embedded in its own process.

InProcessLeases is P's (lease, withdraw, refuse, and hear every release once);
InProcessTransfers is D's, below.

InProcessTransfers: an engine's transfers to a D server embedded in its own process.

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
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvsvc.client.client import blocks_proto
from kvsvc.errors import KvsvcError, PermissionDenied, Unreachable
from kvsvc.leases.table import Lease, LeaseState, NotifyKind, SubscriberBehind
from kvsvc.service import prefill, progressive
from kvsvc.v1 import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kvsvc.service.server import RunningServer

log = logging.getLogger(__name__)

# on_release(request_id, how its lease ended): called on the server's loop.
ReleaseCallback = Callable[[str, LeaseState], None]


class InProcessLeases:
    """P's leases for the engine that embeds the server, as calls on the server's loop.

    One release stream: on_release hears every lease this server releases, once, in the
    order they were released -- including leases made by others (PublishBlocks); a
    withdrawn lease is not announced (its taker knows). The stream is an in-process
    subscription, made before any lease can exist. If the loop stalls so long that 64 MiB
    of releases wait unread, the table drops them (SubscriberBehind): the stream is made
    again, and each lease the engine may be waiting for -- those made here, and the ids
    `waiting_for()` names -- that is no longer live is reported as its tombstone says
    (EXPIRED when even that is forgotten). Use it on the server's loop only.
    """

    def __init__(self, running: RunningServer, on_release: ReleaseCallback,
                 waiting_for: Callable[[], Iterable[str]] = tuple) -> None:
        self._node = running.node
        self._on_release = on_release
        self._waiting_for = waiting_for
        self._leased: set[str] = set()  # made here, not yet heard released (bounded by live leases)
        self.gap_repairs = 0  # times the stream was made again and the gap looked up
        self._sub = self._node.leases.subscribe()
        self._watch = asyncio.get_running_loop().create_task(self._watch_releases(), name="kvsvc in-process releases")

    @property
    def epoch(self) -> int:
        return self._node.epoch

    def lease(self, req: pb.PublishBlocksRequest) -> Lease:
        """Check and lease req's blocks on this server, at once; raises KvsvcError when refused."""
        lease, _ = prefill.lease_here(self._node, req)
        self._leased.add(req.request_id)
        return lease

    def commit(self, req: pb.CommitBlocksRequest) -> pb.CommitBlocksResponse:
        """Append a chunk to a progressive lease made here (PublishBlocksRequest.progressive);
        raises KvsvcError when refused (LEASE_EXPIRED once D gave it up or it expired)."""
        return progressive.commit(self._node, req)

    def withdraw(self, request_id: str, token: str, *, even_final: bool = False) -> bool:
        """Take back an unclaimed lease, or a progressive one not final yet (claimed or not;
        even_final: final too -- the engine freed its blocks, e.g. preempted the request).
        True: the blocks are the engine's again (withdrawn, already released, or never made;
        no release is announced; a D following a growing lease fails typed and never uses
        what its READs still in flight read); False: D holds a claim on a whole lease and
        reads, and the release that ends it comes through on_release."""
        try:
            self._node.leases.notify(request_id, NotifyKind.ABORTED, [], self._node.epoch, token=token, withdraw=True,
                                     even_final=even_final)
        except PermissionDenied:
            return False
        self._leased.discard(request_id)
        return True

    def refuse(self, request_id: str, token: str) -> None:
        """The engine could not lease request_id under token: a D waiting for it fails now."""
        self._node.leases.refuse(request_id, token)

    def is_live(self, request_id: str) -> bool:
        return self._node.leases.get(request_id) is not None

    def final_state(self, request_id: str) -> LeaseState | None:
        """How request_id's lease ended (None: live, or never known here)."""
        return self._node.leases.final_state(request_id)

    async def close(self) -> None:
        self._watch.cancel()
        await asyncio.gather(self._watch, return_exceptions=True)
        self._sub.close()

    async def _watch_releases(self) -> None:
        while True:
            try:
                async for ev in self._sub:
                    self._report(ev.request_id, ev.reason)
                return  # the table closed: the server stops
            except SubscriberBehind as e:
                log.warning("the in-process release stream fell behind (%s); watching again", e)
            self._sub.close()
            self._sub = self._node.leases.subscribe()  # first: a release from now on comes through it
            self._report_gap()

    def _report(self, request_id: str, how: LeaseState) -> None:
        self._leased.discard(request_id)
        try:
            self._on_release(request_id, how)
        except Exception:
            log.exception("handling the release of %s failed", request_id)

    def _report_gap(self) -> None:
        table = self._node.leases
        for rid in sorted(self._leased | set(self._waiting_for())):
            if table.get(rid) is None:
                how = table.final_state(rid) or LeaseState.EXPIRED
                log.info("%s was released while the release stream was behind (%s)", rid, how.value)
                self._report(rid, how)
        self.gap_repairs += 1


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
        *, timeout_s: float | None = None, traceparent: str = "", local_prefix_tokens: int = 0,
    ) -> pb.TransferResponse:
        """As TransferChannel.transfer (traceparent is not needed in process: the caller's
        span, if any, is the current one)."""
        del traceparent
        if self._closed:
            raise Unreachable("the in-process carrier was closed")
        assert asyncio.get_running_loop() is self._loop, "call on the server's event loop"
        req = pb.TransferRequest(request_id=request_id, params=params, local_prefix_tokens=local_prefix_tokens,
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
