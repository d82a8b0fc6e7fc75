"""D-side cache of prefill peers: one handshake per (address, epoch), single-flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.client.lease_channel import LeaseCalls, LeaseChannel
from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError, Unavailable, Unreachable
from kvsvc.limits import check_tp_size
from kvsvc.mapping.planner import Side, validate_pair
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service.node import Node
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class RemoteRank:
    """One P rank as D needs it: its NIXL agent name and its regions' absolute base addresses."""

    rank: int
    agent_name: str
    region_bases: list[int]
    memory_kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    bases: np.ndarray = field(init=False, repr=False)
    """region_bases as an array, made once (every transfer indexes it)."""

    def __post_init__(self) -> None:
        self.bases = np.asarray(self.region_bases, dtype=np.int64)


@dataclass
class Peer:
    """A handshaken prefill server. users counts transfers using it; a retired peer (its
    server restarted) is closed when the last of them lets go, never under them."""

    address: str
    engine_id: str
    epoch: int
    side: Side
    ranks: dict[int, RemoteRank]
    client: AsyncClient
    users: int = 0
    retired: bool = False
    lease: LeaseChannel | None = None
    node_id: str = ""  # the peer's host (HandshakeResponse.node_id; "" from an older server)
    transport: pb.PeerTransport | None = None  # how READs from it travel, once known (peer_transports.py)
    transport_looks: int = 0  # times the protocol log was read for it without finding it

    @property
    def lease_calls(self) -> LeaseCalls:
        """Where ClaimLease and Notify go: the peer's LeaseChannel (else unary calls)."""
        return self.lease if self.lease is not None else self.client

    @property
    def tp_size(self) -> int:
        return self.side.tp_size


def peer_client_options(node: Node, engine_id: str = "") -> ClientOptions:
    """How this server dials peers: TLS with peer_tls_ca_file, presenting its own certificate.

    Under TLS the peer's certificate must name engine_id (when given): the TLS check then
    proves that the server at the address really is the engine the params name.
    """
    cfg = node.config
    # One retry: a peer that is down is reported PEER_UNAVAILABLE quickly, not dialled a dozen times
    # (a refused connection fails at once). A peer that accepted but answers slowly gets the whole
    # peer deadline, not gRPC's 20 s connect limit.
    opts = ClientOptions(timeout_s=cfg.peer_timeout_s, retries=1, max_message_bytes=cfg.max_message_bytes,
                         connect_timeout_ms=int(cfg.peer_timeout_s * 1000))
    if not cfg.peer_tls_ca_file:
        return opts
    return opts.with_pem_files(cfg.peer_tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file, engine_id or None)


class Peers(Protocol):
    """What the decoder asks of its P servers' cache (PeerCache; tests hand in fakes)."""

    def use(self, address: str, expected_engine_id: str, want_epoch: int) -> AbstractAsyncContextManager[Peer]:
        """The peer at address with epoch want_epoch, held while the block runs."""

    def listing(self) -> list[Peer]: ...

    async def side_of(self, address: str) -> Side: ...

    @property
    def cached(self) -> int: ...

    async def close(self) -> None: ...


STALE_EPOCHS_KEPT = 64


class PeerCache:
    """Handshakes on demand, one per (address, epoch), single-flight.

    A request naming an epoch other than the cached one either is stale (P did not
    restart: answered LEASE_EXPIRED from a remembered set, after at most one GetInfo) or
    reveals a restart (the peer is re-handshaken and the old one retired). Nothing a
    request does pulls a peer from under the transfers using it.
    """

    def __init__(self, node: Node) -> None:
        self._node = node
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}  # callers holding or waiting for each lock
        self._stale: dict[str, OrderedDict[int, None]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def use(self, address: str, expected_engine_id: str, want_epoch: int) -> AsyncIterator[Peer]:
        """The peer at address with epoch want_epoch, held for the duration of the block."""
        peer = await self._acquire(address, expected_engine_id, want_epoch)
        try:
            yield peer
        finally:
            peer.users -= 1
            if peer.retired and peer.users == 0:
                self._close_later(peer)

    async def _acquire(self, address: str, expected_engine_id: str, want_epoch: int) -> Peer:
        if want_epoch in self._stale.get(address, ()):
            raise self._stale_error(address, want_epoch, self._peers.get(address))
        lock = self._locks.setdefault(address, asyncio.Lock())
        self._lock_users[address] = self._lock_users.get(address, 0) + 1
        try:
            async with lock:  # single flight: concurrent transfers to one peer share one handshake
                peer = self._peers.get(address)
                if peer is not None and peer.epoch != want_epoch:
                    if await self._epoch_of(peer.client) == peer.epoch:
                        raise self._remember_stale(address, want_epoch, peer)
                    log.info("peer %s restarted (epoch %d -> new): re-handshaking", address, peer.epoch)
                    self._node.metrics.rehandshake()
                    self._retire(peer)
                    peer = None
                if peer is None:
                    try:
                        peer = await self._handshake(address, expected_engine_id)
                    except Exception:
                        self._node.metrics.handshake(expected_engine_id, ok=False)
                        raise
                    self._node.metrics.handshake(peer.engine_id, ok=True)
                    self._peers[address] = peer
                if expected_engine_id and peer.engine_id != expected_engine_id:
                    raise FailedPrecondition(Reason.UNKNOWN_ENGINE, f"{address} hosts engine {peer.engine_id!r}, not "
                                             f"{expected_engine_id!r}", {"address": address,
                                                                         "engine_id": peer.engine_id})
                if peer.epoch != want_epoch:
                    raise self._remember_stale(address, want_epoch, peer)
                peer.users += 1
                return peer
        finally:
            self._lock_users[address] -= 1
            if not self._lock_users[address]:
                del self._lock_users[address]
                if address not in self._peers:
                    self._locks.pop(address, None)  # no state kept for addresses that never answered

    async def _epoch_of(self, client: AsyncClient) -> int:
        """P's epoch now (one GetInfo over the channel); 0 when P does not answer."""
        try:
            return int((await client.get_info(timeout_s=min(2.0, self._node.config.peer_timeout_s))).epoch)
        except KvsvcError:
            return 0

    def _remember_stale(self, address: str, epoch: int, peer: Peer) -> KvsvcError:
        stale = self._stale.setdefault(address, OrderedDict())
        stale[epoch] = None
        while len(stale) > STALE_EPOCHS_KEPT:
            stale.popitem(last=False)
        return self._stale_error(address, epoch, peer)

    @staticmethod
    def _stale_error(address: str, epoch: int, peer: Peer | None) -> KvsvcError:
        now = peer.epoch if peer is not None else 0
        return FailedPrecondition(Reason.LEASE_EXPIRED, f"the lease was made by an earlier run of {address} (epoch "
                                  f"{epoch}, now {now}): the prefill server restarted",
                                  {"lease_epoch": epoch, "server_epoch": now, "address": address})

    def _retire(self, peer: Peer) -> None:
        self._peers.pop(peer.address, None)
        self._stale.pop(peer.address, None)  # epochs remembered as stale belonged to the old run's view
        peer.retired = True
        if peer.users == 0:
            self._close_later(peer)

    def _close_later(self, peer: Peer) -> None:
        task = asyncio.get_running_loop().create_task(self._close_peer(peer))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_peer(self, peer: Peer) -> None:
        """Forget the peer's NIXL remote agents and close its channel (nothing uses them now)."""
        try:
            if self._node.data is not None:
                await self._node.data.forget({r.agent_name for r in peer.ranks.values()})
        finally:
            if peer.lease is not None:
                await peer.lease.close()
            await peer.client.close()

    @property
    def cached(self) -> int:
        return len(self._peers)

    def listing(self) -> list[Peer]:
        """The handshaken peers in use now (retired ones are on their way out)."""
        return sorted(self._peers.values(), key=lambda p: p.address)

    async def side_of(self, address: str) -> Side:
        """A remote engine's layout and TP, for planning only: no NIXL wiring, no data plane needed."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer.side
        try:
            async with AsyncClient(address, peer_client_options(self._node)) as client:
                info = await client.get_info()
        except KvsvcError as e:
            if e.code is ErrorCode.UNAVAILABLE:
                raise Unavailable(Reason.PEER_UNAVAILABLE, f"server {address} is unreachable: {e.message}",
                                  {"address": address}) from e
            raise
        return Side.of(layout_from_proto(info.layout, "remote.layout", info.tp_size), info.tp_size)

    async def _handshake(self, address: str, expected_engine_id: str) -> Peer:
        node = self._node
        data = node.require_data_plane("Transfer")
        client = AsyncClient(address, peer_client_options(node, expected_engine_id))
        started = time.perf_counter()
        try:
            # Every rank the P server hosts (metadata is ~0.5 KB a rank): one round trip, and
            # the TP mapping below picks the ones each local rank needs.
            resp = await client.handshake(pb.HandshakeRequest(
                engine_id=node.config.engine_id, tp_size=node.config.tp_size, layout=layout_to_proto(node.layout),
                layout_hash=node.layout_hash, expected_engine_id=expected_engine_id))
            answered = time.perf_counter()
            check_tp_size(resp.tp_size, "handshake.tp_size")  # a peer's answer is input like any other
            side = Side.of(layout_from_proto(resp.layout, "handshake.layout", resp.tp_size), resp.tp_size)
            validate_pair(node.side, side)  # both sides check: never trust one
            ranks = {h.tp_rank: RemoteRank(h.tp_rank, h.agent_name, [r.base_address for r in h.regions],
                                           MemoryKind.VRAM if h.memory_kind == pb.MEMORY_KIND_VRAM else MemoryKind.DRAM, h.device_id)
                     for h in resp.ranks}
            peer = Peer(address, resp.engine_id, resp.epoch, side, ranks, client,
                        lease=LeaseChannel(client, resp.lease_socket), node_id=resp.node_id)
            try:
                for h in resp.ranks:
                    for t in node.hosted_ranks:
                        if h.tp_rank in handshake_target_ranks(t, node.config.tp_size, resp.tp_size,
                                                               node.layout.dcp_size, side.layout.dcp_size):
                            await data.connect(t, h.agent_metadata, h.agent_name)
            except BaseException as e:
                # Half-wired: forget what was added. A NIXL failure right after P answered is
                # most often P going away; say so when P no longer answers.
                await asyncio.shield(data.forget({r.agent_name for r in ranks.values()}))
                if isinstance(e, KvsvcError) and not await self._epoch_of(client):
                    raise Unreachable(f"lost {address} while connecting: {e.message}") from e
                raise
        except KvsvcError as e:
            await client.close()
            if e.code is ErrorCode.UNAVAILABLE:
                raise Unavailable(Reason.PEER_UNAVAILABLE, f"prefill server {address} is unreachable: {e.message}",
                                  {"address": address}) from e
            raise
        except BaseException:
            await client.close()
            raise
        log.info("handshake with %s (%s, epoch %d, TP %d): answered in %.1f ms, wired in %.1f ms", address,
                 peer.engine_id, peer.epoch, peer.tp_size, 1e3 * (answered - started),
                 1e3 * (time.perf_counter() - answered))
        return peer

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            self._retire(peer)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
