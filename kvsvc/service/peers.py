"""D-side cache of prefill peers: one handshake per (address, epoch), single-flight."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.codec import layout_from_proto, layout_to_proto
from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError, Unavailable
from kvsvc.mapping.planner import Side, validate_pair
from kvsvc.mapping.topology import handshake_target_ranks
from kvsvc.service.node import Node
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class RemoteRank:
    """One P rank as D needs it: its NIXL agent name and its regions' absolute base addresses."""

    rank: int
    agent_name: str
    region_bases: list[int]
    memory_kind: str = "DRAM"
    device_id: int = 0


@dataclass
class Peer:
    """A handshaken prefill server."""

    address: str
    engine_id: str
    epoch: int
    side: Side
    ranks: dict[int, RemoteRank]
    client: AsyncClient

    @property
    def tp_size(self) -> int:
        return self.side.tp_size


def peer_client_options(node: Node) -> ClientOptions:
    """How this server dials peers: TLS with peer_tls_ca_file, presenting its own certificate."""
    cfg = node.config
    opts = ClientOptions(timeout_s=cfg.peer_timeout_s, retries=2, max_message_bytes=cfg.max_message_bytes)
    if not cfg.peer_tls_ca_file:
        return opts
    own = bool(cfg.tls_cert_file)
    return replace(opts, tls_root_certs=Path(cfg.peer_tls_ca_file).read_bytes(),
                   tls_client_cert=Path(cfg.tls_cert_file).read_bytes() if own else None,
                   tls_client_key=Path(cfg.tls_key_file).read_bytes() if own else None)


class PeerCache:
    """Handshakes on demand; a new epoch drops the old peer and its NIXL remote agents."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, address: str, expected_engine_id: str, want_epoch: int) -> Peer:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:  # single flight: concurrent transfers to one peer share one handshake
            peer = self._peers.get(address)
            if peer is not None and want_epoch and peer.epoch != want_epoch:
                log.info("peer %s epoch changed (%d -> %d): re-handshaking", address, peer.epoch, want_epoch)
                await self._drop(peer)
                peer = None
            if peer is None:
                peer = await self._handshake(address, expected_engine_id)
                self._peers[address] = peer
        if expected_engine_id and peer.engine_id != expected_engine_id:
            raise FailedPrecondition("UNKNOWN_ENGINE", f"{address} hosts engine {peer.engine_id!r}, not "
                                     f"{expected_engine_id!r}", {"address": address, "engine_id": peer.engine_id})
        if want_epoch and peer.epoch != want_epoch:
            raise FailedPrecondition("LEASE_EXPIRED", f"the lease was made by an earlier run of {address} (epoch "
                                     f"{want_epoch}, now {peer.epoch}): the prefill server restarted",
                                     {"lease_epoch": want_epoch, "server_epoch": peer.epoch, "address": address})
        return peer

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
                raise Unavailable("PEER_UNAVAILABLE", f"server {address} is unreachable: {e.message}",
                                  {"address": address}) from e
            raise
        return Side.of(layout_from_proto(info.layout, "remote.layout", info.tp_size), info.tp_size)

    async def _drop(self, peer: Peer) -> None:
        self._peers.pop(peer.address, None)
        if self._node.data is not None:
            await self._node.data.forget({r.agent_name for r in peer.ranks.values()})
        await peer.client.close()

    async def _handshake(self, address: str, expected_engine_id: str) -> Peer:
        node = self._node
        data = node.require_data_plane("Transfer")
        client = AsyncClient(address, peer_client_options(node))
        try:
            # Every rank the P server hosts (metadata is ~0.5 KB a rank): one round trip, and
            # the TP mapping below picks the ones each local rank needs.
            resp = await client.handshake(pb.HandshakeRequest(
                engine_id=node.config.engine_id, tp_size=node.config.tp_size, layout=layout_to_proto(node.layout),
                layout_hash=node.layout_hash, expected_engine_id=expected_engine_id))
            side = Side.of(layout_from_proto(resp.layout, "handshake.layout", resp.tp_size), resp.tp_size)
            validate_pair(node.side, side)  # both sides check: never trust one
            ranks = {h.tp_rank: RemoteRank(h.tp_rank, h.agent_name, [r.base_address for r in h.regions],
                                           "VRAM" if h.memory_kind == pb.MEMORY_KIND_VRAM else "DRAM", h.device_id)
                     for h in resp.ranks}
            peer = Peer(address, resp.engine_id, resp.epoch, side, ranks, client)
            for h in resp.ranks:
                for t in node.hosted_ranks:
                    if h.tp_rank in handshake_target_ranks(t, node.config.tp_size, resp.tp_size):
                        await data.connect(t, h.agent_metadata, h.agent_name)
        except KvsvcError as e:
            await client.close()
            if e.code is ErrorCode.UNAVAILABLE:
                raise Unavailable("PEER_UNAVAILABLE", f"prefill server {address} is unreachable: {e.message}",
                                  {"address": address}) from e
            raise
        except BaseException:
            await client.close()
            raise
        log.info("handshake with %s (%s, epoch %d, TP %d)", address, peer.engine_id, peer.epoch, peer.tp_size)
        return peer

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            await peer.client.close()
        self._peers.clear()
