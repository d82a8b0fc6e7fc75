"""AsyncClient / Client: one method per RPC, deadlines, retries on UNAVAILABLE only."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvsvc.client.errors import error_from_rpc
from kvsvc.errors import KvsvcError, Unavailable, Unreachable
from kvsvc.loops import stop_loop_thread
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc

T = TypeVar("T")


if TYPE_CHECKING:
    from kvsvc.client.lease_channel import LeaseChannel
    from kvsvc.client.transfer_stream import TransferChannel

@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client dials and retries."""

    timeout_s: float = 30.0
    """Default deadline of one call, seconds."""
    retries: int = 3
    """Extra attempts of idempotent calls when the server could not be reached (UNAVAILABLE
    without a kvsvc reason). Never on other codes or on the server's own answers; never for
    PublishBlocks (a lost answer would make the retry a second publish)."""
    backoff_s: float = 0.05
    """First retry delay, seconds; doubles each attempt, with jitter."""
    connect_timeout_ms: int | None = None
    """How long one connection attempt may take (TCP, TLS and the server's first HTTP/2
    frame) before gRPC gives up on it; gRPC's own default is 20 s. A server that accepted the
    connection but is slow to answer (a busy host) is waited for this long."""
    keepalive_time_ms: int = 30_000
    """Ping interval; the server permits pings every 10 s or slower."""
    max_reconnect_backoff_ms: int = 5_000
    """Longest wait between connection attempts to a server that could not be reached (gRPC's
    own default grows to 120 s): a peer back after an outage is reached again within this,
    not minutes later. gRPC only dials while calls wait, so a peer gone for good costs
    nothing when unused."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest message sent or received, bytes."""
    tls_root_certs: bytes | None = None
    """PEM roots; set (with the optional client pair) for a TLS channel."""
    tls_client_cert: bytes | None = None
    """PEM client certificate for mTLS."""
    tls_client_key: bytes | None = None
    """PEM client key for mTLS."""
    tls_server_name: str | None = None
    """Name the server's certificate must carry instead of the dialled host (kvsvc servers
    dial peers with the peer's engine id here)."""

    def channel_options(self) -> list[tuple[str, int | str]]:
        opts: list[tuple[str, int | str]] = [
            # Each channel dials for itself: with gRPC's process-wide subchannel pool a new
            # channel to a restarted server would inherit the dead one's reconnect backoff.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        if self.connect_timeout_ms is not None:  # gRPC's name for a connect attempt's minimum deadline
            opts.append(("grpc.min_reconnect_backoff_ms", self.connect_timeout_ms))
        opts.append(("grpc.max_reconnect_backoff_ms", max(self.max_reconnect_backoff_ms, self.connect_timeout_ms or 0)))
        if self.tls_server_name and self.tls_root_certs is not None:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return opts

    def with_pem_files(self, ca: str, cert: str = "", key: str = "", server_name: str | None = None) -> ClientOptions:
        """These options over TLS: roots from the PEM file ca, and the client pair cert/key
        (mutual TLS) when given."""
        return replace(self, tls_root_certs=Path(ca).read_bytes(),
                       tls_client_cert=Path(cert).read_bytes() if cert else None,
                       tls_client_key=Path(key).read_bytes() if key else None, tls_server_name=server_name)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls_root_certs is None:
            return None
        return grpc.ssl_channel_credentials(self.tls_root_certs, self.tls_client_key, self.tls_client_cert)


class ReleaseStream:
    """An open WatchReleases call: iterate it for releases, cancel() to stop."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __aiter__(self) -> AsyncIterator[pb.WatchReleasesResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[pb.WatchReleasesResponse]:
        try:
            async for event in self._call:
                yield event
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise error_from_rpc(e) from None

    def cancel(self) -> None:
        self._call.cancel()


def blocks_proto(ids_per_group: Sequence[Sequence[int]]) -> list[pb.BlockIds]:
    return [pb.BlockIds(block_ids=[int(b) for b in ids]) for ids in ids_per_group]


class AsyncClient:
    """kvsvc.v1 over grpc.aio. Use `async with AsyncClient(addr) as c:`."""

    def __init__(self, address: str, options: ClientOptions | None = None) -> None:
        self.address = address
        self.options = options or ClientOptions()
        creds = self.options.credentials()
        opts = self.options.channel_options()
        self._channel = (grpc.aio.secure_channel(address, creds, opts) if creds
                         else grpc.aio.insecure_channel(address, opts))
        self._stub = pb_grpc.KvTransferServiceStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    @property
    def channel(self) -> grpc.aio.Channel:
        """The underlying channel (for calls this class does not wrap, e.g. LeaseChannel)."""
        return self._channel

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, rpc: Callable[..., Any], request: Any, timeout_s: float | None,
                    idempotent: bool = True, traceparent: str = "") -> Any:
        delay = self.options.backoff_s
        attempts = self.options.retries + 1 if idempotent else 1
        for attempt in range(attempts):
            try:
                return await rpc(request, timeout=timeout_s or self.options.timeout_s,
                                 metadata=(("traceparent", traceparent),) if traceparent else None)
            except grpc.aio.AioRpcError as e:
                err = error_from_rpc(e)
                if not isinstance(err, Unreachable) or attempt == attempts - 1:
                    raise err from None
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay *= 2
        raise AssertionError("unreachable")

    async def get_info(self, *, timeout_s: float | None = None) -> pb.GetInfoResponse:
        return await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout_s)  # type: ignore[no-any-return]

    async def handshake(self, request: pb.HandshakeRequest, *, timeout_s: float | None = None) -> pb.HandshakeResponse:
        return await self._call(self._stub.Handshake, request, timeout_s)  # type: ignore[no-any-return]

    async def publish_blocks(
        self, request_id: str, block_ids_per_group: Sequence[Sequence[int]], *, lease_ttl_ms: int = 0,
        num_tokens: int = 0, timeout_s: float | None = None,
    ) -> pb.PublishBlocksResponse:
        """Lease a request's blocks; num_tokens (the request's length) is required on a DCP engine."""
        req = pb.PublishBlocksRequest(request_id=request_id, block_ids_per_group=blocks_proto(block_ids_per_group),
                                      lease_ttl_ms=lease_ttl_ms, num_tokens=num_tokens)
        return await self.publish_blocks_request(req, timeout_s=timeout_s)

    async def publish_blocks_request(self, request: pb.PublishBlocksRequest, *,
                                     timeout_s: float | None = None) -> pb.PublishBlocksResponse:
        """PublishBlocks with a whole request message (never retried: see ClientOptions.retries)."""
        return await self._call(self._stub.PublishBlocks, request, timeout_s, idempotent=False)  # type: ignore[no-any-return]

    async def commit_blocks(self, request: pb.CommitBlocksRequest, *,
                            timeout_s: float | None = None) -> pb.CommitBlocksResponse:
        """Append a chunk to a progressive lease (retried safely: a commit sent again with the
        same epoch and blocks is answered as the first)."""
        return await self._call(self._stub.CommitBlocks, request, timeout_s)  # type: ignore[no-any-return]

    async def wait_commit(self, request: pb.WaitCommitRequest, *,
                          timeout_s: float | None = None) -> pb.WaitCommitResponse:
        """The blocks a progressive lease committed after request.after_epoch, waiting up to
        request.wait_ms for the next commit (timeout_s should leave room for that wait)."""
        return await self._call(self._stub.WaitCommit, request, timeout_s)  # type: ignore[no-any-return]

    async def claim_lease(self, request: pb.ClaimLeaseRequest, *, timeout_s: float | None = None,
                          traceparent: str = "") -> pb.ClaimLeaseResponse:
        """traceparent: the W3C trace context of the transfer this claim is for, if any."""
        return await self._call(self._stub.ClaimLease, request, timeout_s,  # type: ignore[no-any-return]
                                traceparent=traceparent)

    async def plan_transfer(self, request: pb.PlanTransferRequest, *, timeout_s: float | None = None) -> pb.PlanTransferResponse:
        return await self._call(self._stub.PlanTransfer, request, timeout_s)  # type: ignore[no-any-return]

    async def transfer(
        self, request_id: str, params: pb.TransferParams, local_block_ids_per_group: Sequence[Sequence[int]],
        *, timeout_s: float | None = None, local_prefix_tokens: int = 0,
    ) -> pb.TransferResponse:
        """local_prefix_tokens: progressive params only (TransferRequest.local_prefix_tokens)."""
        req = pb.TransferRequest(request_id=request_id, params=params,
                                 local_block_ids_per_group=blocks_proto(local_block_ids_per_group),
                                 local_prefix_tokens=local_prefix_tokens)
        return await self.transfer_request(req, timeout_s=timeout_s)

    async def transfer_request(self, req: pb.TransferRequest, *, timeout_s: float | None = None,
                               traceparent: str = "") -> pb.TransferResponse:
        return await self._call(self._stub.Transfer, req, timeout_s,  # type: ignore[no-any-return]
                                traceparent=traceparent)

    def transfer_stream(self, carrier: str = "auto") -> TransferChannel:
        """Transfers over one TransferStream (what an engine that runs many uses; a
        message each instead of a call each): .transfer() as here, .close() when done.

        carrier "auto": on the server's transfer socket when it offers one this process can
        reach (same host, same user, no TLS), else over gRPC; "grpc": always over gRPC."""
        from kvsvc.client.transfer_stream import TransferChannel

        return TransferChannel(self, carrier)

    async def notify(self, request: pb.NotifyRequest, *, timeout_s: float | None = None,
                     traceparent: str = "") -> pb.NotifyResponse:
        return await self._call(self._stub.Notify, request, timeout_s,  # type: ignore[no-any-return]
                                traceparent=traceparent)

    async def list_leases(self, *, limit: int = 0, request_id_prefix: str = "", request_ids: Sequence[str] = (),
                          timeout_s: float | None = None) -> pb.ListLeasesResponse:
        """The server's live leases (soonest to expire first), peers and running transfers; read
        only. request_ids: only those ids' leases, every live one (a lookup by exact id)."""
        req = pb.ListLeasesRequest(limit=limit, request_id_prefix=request_id_prefix, request_ids=list(request_ids))
        return await self._call(self._stub.ListLeases, req, timeout_s)  # type: ignore[no-any-return]

    def lease_channel(self) -> LeaseChannel:
        """ClaimLease and Notify over one LeaseChannel stream (what a D server uses for its
        peers): .claim_lease() / .notify() as here, .close() when done."""
        from kvsvc.client.lease_channel import LeaseChannel

        return LeaseChannel(self)

    async def wait_transfer(self, request_id: str, *, wait_ms: int = 30_000,
                            timeout_s: float | None = None) -> pb.WaitTransferResponse:
        """The settled state of the D-side transfer request_id, waiting up to wait_ms for it.

        Call it after a Transfer that failed without a TransferFailure detail (cancelled,
        deadline passed in the network, connection lost) before reusing its local blocks:
        any state but RUNNING or QUARANTINED means nothing writes into them any more.
        """
        req = pb.WaitTransferRequest(request_id=request_id, wait_ms=wait_ms)
        timeout = timeout_s or max(self.options.timeout_s, wait_ms / 1000 + 5.0)
        return await self._call(self._stub.WaitTransfer, req, timeout)  # type: ignore[no-any-return]

    async def settled(self, request_id: str, error: BaseException | None = None) -> pb.WaitTransferResponse | None:
        """Return once the transfer request_id can no longer write into its local blocks.

        error is what Transfer raised, if anything: a kvsvc error carrying TransferFailure
        was answered after the READs settled, so no question is needed (returns None) --
        unless the failure says quarantined (READs of it may still land). Otherwise
        (cancelled, deadline passed on the way, connection lost, quarantined) this asks
        WaitTransfer until the answer is neither RUNNING nor QUARANTINED.
        """
        failure = next((d for d in getattr(error, "details", ()) if isinstance(d, pb.TransferFailure)), None)
        if isinstance(error, KvsvcError) and failure is not None and not failure.quarantined:
            return None
        while True:
            state = await self.wait_transfer(request_id)
            if state.state not in (pb.TRANSFER_STATE_RUNNING, pb.TRANSFER_STATE_QUARANTINED):
                return state

    async def open_release_stream(self) -> ReleaseStream:
        """Subscribe to WatchReleases; returns once the server has registered the subscription."""
        call = self._stub.WatchReleases(pb.WatchReleasesRequest())
        try:
            await call.initial_metadata()
            if call.done():  # a refusal comes as a trailers-only answer: headers and the error at once
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
        return ReleaseStream(call)

    async def watch_releases(self) -> AsyncIterator[pb.WatchReleasesResponse]:
        """Stream released requests until the server or the caller ends it."""
        stream = await self.open_release_stream()
        try:
            async for event in stream:
                yield event
        finally:
            stream.cancel()


class Client:
    """Blocking twin of AsyncClient, for scripts and engines without an event loop.

    Its calls run on a private event loop in a thread of its own, so a Client also works
    where an event loop is already running (a notebook, an async engine): the calling
    thread blocks until the answer comes, so inside a coroutine prefer AsyncClient, which
    does not hold up the caller's loop. Keyword arguments are AsyncClient's: every call
    takes timeout_s (seconds; default ClientOptions.timeout_s).
    """

    def __init__(self, address: str, options: ClientOptions | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvsvc-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._async = self._run(self._make(address, options))

    @staticmethod
    async def _make(address: str, options: ClientOptions | None) -> AsyncClient:
        return AsyncClient(address, options)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise Unavailable(Reason.CLIENT_CLOSED, "this Client was closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel and stop the client's thread; idempotent."""
        if self._closed:
            return
        try:
            self._run(self._async.close())
        finally:
            self._closed = True
            stop_loop_thread(self._loop, self._thread)

    def get_info(self, *, timeout_s: float | None = None) -> pb.GetInfoResponse:
        return self._run(self._async.get_info(timeout_s=timeout_s))

    def handshake(self, request: pb.HandshakeRequest, *, timeout_s: float | None = None) -> pb.HandshakeResponse:
        return self._run(self._async.handshake(request, timeout_s=timeout_s))

    def publish_blocks(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]], *, lease_ttl_ms: int = 0,
                       num_tokens: int = 0, timeout_s: float | None = None) -> pb.PublishBlocksResponse:
        """Lease blocks for D to read; lease_ttl_ms 0: the server's default; num_tokens: the
        request's length (needed under DCP)."""
        return self._run(self._async.publish_blocks(request_id, block_ids_per_group, lease_ttl_ms=lease_ttl_ms,
                                                    num_tokens=num_tokens, timeout_s=timeout_s))

    def publish_blocks_request(self, request: pb.PublishBlocksRequest, *,
                               timeout_s: float | None = None) -> pb.PublishBlocksResponse:
        return self._run(self._async.publish_blocks_request(request, timeout_s=timeout_s))

    def claim_lease(self, request: pb.ClaimLeaseRequest, *, timeout_s: float | None = None,
                    traceparent: str = "") -> pb.ClaimLeaseResponse:
        return self._run(self._async.claim_lease(request, timeout_s=timeout_s, traceparent=traceparent))

    def commit_blocks(self, request: pb.CommitBlocksRequest, *,
                      timeout_s: float | None = None) -> pb.CommitBlocksResponse:
        return self._run(self._async.commit_blocks(request, timeout_s=timeout_s))

    def wait_commit(self, request: pb.WaitCommitRequest, *, timeout_s: float | None = None) -> pb.WaitCommitResponse:
        return self._run(self._async.wait_commit(request, timeout_s=timeout_s))

    def plan_transfer(self, request: pb.PlanTransferRequest, *, timeout_s: float | None = None) -> pb.PlanTransferResponse:
        return self._run(self._async.plan_transfer(request, timeout_s=timeout_s))

    def transfer(self, request_id: str, params: pb.TransferParams,
                 local_block_ids_per_group: Sequence[Sequence[int]], *,
                 timeout_s: float | None = None, local_prefix_tokens: int = 0) -> pb.TransferResponse:
        """Read params' blocks into local_block_ids_per_group (request_id: the D-side id)."""
        return self._run(self._async.transfer(request_id, params, local_block_ids_per_group, timeout_s=timeout_s,
                                              local_prefix_tokens=local_prefix_tokens))

    def notify(self, request: pb.NotifyRequest, *, timeout_s: float | None = None,
               traceparent: str = "") -> pb.NotifyResponse:
        return self._run(self._async.notify(request, timeout_s=timeout_s, traceparent=traceparent))

    def list_leases(self, *, limit: int = 0, request_id_prefix: str = "", request_ids: Sequence[str] = (),
                    timeout_s: float | None = None) -> pb.ListLeasesResponse:
        """Live leases, peers and running transfers (read only; limit 0: the server's default;
        request_ids: a lookup by exact id)."""
        return self._run(self._async.list_leases(limit=limit, request_id_prefix=request_id_prefix,
                                                 request_ids=request_ids, timeout_s=timeout_s))

    def lease_channel(self) -> SyncLeaseChannel:
        """The blocking twin of AsyncClient.lease_channel()."""
        return SyncLeaseChannel(self._run, self._async.lease_channel())

    def transfer_stream(self, carrier: str = "auto") -> SyncTransferChannel:
        """The blocking twin of AsyncClient.transfer_stream() (a blocking caller waits for
        each transfer; run several from threads to have them share the stream)."""
        return SyncTransferChannel(self._run, self._async.transfer_stream(carrier))

    def wait_transfer(self, request_id: str, *, wait_ms: int = 30_000,
                      timeout_s: float | None = None) -> pb.WaitTransferResponse:
        return self._run(self._async.wait_transfer(request_id, wait_ms=wait_ms, timeout_s=timeout_s))

    def settled(self, request_id: str, error: BaseException | None = None) -> pb.WaitTransferResponse | None:
        """See AsyncClient.settled: returns once nothing can write into the request's blocks."""
        return self._run(self._async.settled(request_id, error))

    def watch_releases(self, max_events: int, timeout_s: float) -> list[pb.WatchReleasesResponse]:
        """Collect up to max_events releases, waiting at most timeout_s seconds."""

        async def collect() -> list[pb.WatchReleasesResponse]:
            out: list[pb.WatchReleasesResponse] = []

            async def take() -> None:
                async for ev in self._async.watch_releases():
                    out.append(ev)
                    if len(out) >= max_events:
                        return

            try:
                await asyncio.wait_for(take(), timeout_s)
            except TimeoutError:
                pass
            return out

        return self._run(collect())


class SyncLeaseChannel:
    """A LeaseChannel driven by a Client's event loop: blocking claim_lease / notify / close."""

    def __init__(self, run: Callable[[Coroutine[Any, Any, Any]], Any], channel: LeaseChannel) -> None:
        self._run, self._channel = run, channel

    def claim_lease(self, request: pb.ClaimLeaseRequest, *, timeout_s: float | None = None,
                    traceparent: str = "") -> pb.ClaimLeaseResponse:
        return self._run(self._channel.claim_lease(request, timeout_s=timeout_s, traceparent=traceparent))  # type: ignore[no-any-return]

    def notify(self, request: pb.NotifyRequest, *, timeout_s: float | None = None,
               traceparent: str = "") -> pb.NotifyResponse:
        return self._run(self._channel.notify(request, timeout_s=timeout_s, traceparent=traceparent))  # type: ignore[no-any-return]

    def close(self) -> None:
        self._run(self._channel.close())


class SyncTransferChannel:
    """A TransferChannel driven by a Client's event loop: blocking transfer / close."""

    def __init__(self, run: Callable[[Coroutine[Any, Any, Any]], Any], channel: TransferChannel) -> None:
        self._run, self._channel = run, channel

    @property
    def carrier(self) -> str:
        """See TransferChannel.carrier."""
        return self._channel.carrier

    def transfer(self, request_id: str, params: pb.TransferParams,
                 local_block_ids_per_group: Sequence[Sequence[int]], *,
                 timeout_s: float | None = None) -> pb.TransferResponse:
        return self._run(self._channel.transfer(  # type: ignore[no-any-return]
            request_id, params, local_block_ids_per_group, timeout_s=timeout_s))

    def close(self) -> None:
        self._run(self._channel.close())
