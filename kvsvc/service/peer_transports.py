"""Which transport READs from each prefill server really use, and whether that is a downgrade.

UCX picks a protocol per endpoint configuration, prints it to the protocol log kvsvc keeps
(transport/ucx_probe.py) once per configuration, and never says which peer a table is
for. A peer's configuration follows from what kvsvc knows of it: whether it runs on this
node (HandshakeResponse.node_id against ours) and the memory read from and into. So once a
READ from a peer completed, its tables are in the log: the peer's transports are those of
the READ tables for its locality and memory pair. One not found yet (UCX printed nothing
for it) is looked up again after the peer's next transfers, at most MAX_LOOKS times (the
log is read from disk each time), and never again once found.

A downgrade (TCP within the node; no RDMA between nodes where the operator requires it) is
said once per peer: a warning with reason TRANSPORT_DEGRADED, GetInfo's TransportInfo.peers
and kvsvc_peer_read_transport{degraded="true"}. Transfers go on: the bytes are right, only
slower than they should be.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service.node import Node
from kvsvc.service.peers import Peer
from kvsvc.transport.ucx_probe import ReadPath, degraded_because
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_UCX_MEMORY = {MemoryKind.DRAM: "host", MemoryKind.VRAM: "cuda"}
MAX_LOOKS = 8


def locality(node: Node, peer: Peer) -> str | None:
    """"intra-node" or "inter-node" as kvsvc sees the peer; None when the peer did not say
    where it runs (an older server)."""
    if not peer.node_id:
        return None
    return "intra-node" if peer.node_id == node.node_id else "inter-node"


def peer_transport(node: Node, peer: Peer, paths: Iterable[ReadPath]) -> pb.PeerTransport | None:
    """The peer's READ transports among UCX's READ tables, or None when none applies yet."""
    where = locality(node, peer)
    if where is None:
        return None
    into = {_UCX_MEMORY[pool.memory_kind] for pool in node.pools.values()}
    source = {_UCX_MEMORY[r.memory_kind] for r in peer.ranks.values()}
    mine = [p for p in paths if p.locality == where and p.into in into and p.source in source]
    if not mine:
        return None
    why = [w for p in mine if (w := degraded_because(p, require_rdma=node.config.require_rdma_between_nodes))]
    return pb.PeerTransport(
        address=peer.address, engine_id=peer.engine_id, locality=where,
        read_transports=sorted({t for p in mine for t in p.transports}),
        warning_reason=Reason.TRANSPORT_DEGRADED.value if why else "", warning="; ".join(why))


class PeerTransports:
    """Learns each handshaken peer's READ transports after its transfers, once."""

    def __init__(self, node: Node, read_paths: Callable[[], list[ReadPath]],
                 on_known: Callable[[pb.PeerTransport], None] = lambda _t: None) -> None:
        self._node = node
        self._read_paths = read_paths
        self._on_known = on_known  # e.g. the metric

    def observe(self, peers: Iterable[Peer]) -> None:
        """After a transfer that read from these peers completed: learn those not known yet."""
        unknown = [p for p in peers if p.transport is None and p.node_id and p.transport_looks < MAX_LOOKS]
        if not unknown:
            return
        paths = self._read_paths()
        for peer in unknown:
            known = peer_transport(self._node, peer, paths)
            if known is None:
                peer.transport_looks += 1
                continue
            peer.transport = known
            self._on_known(known)
            if known.warning_reason:
                log.warning("%s: READs from %s (%s) are degraded: %s", Reason.TRANSPORT_DEGRADED.value,
                            peer.address, peer.engine_id, known.warning)
            else:
                log.info("READs from %s (%s, %s) use %s", peer.address, peer.engine_id, known.locality,
                         ", ".join(known.read_transports))


def listing(peers: Iterable[Peer]) -> list[pb.PeerTransport]:
    """The known transports of the peers in use, for GetInfo."""
    return [p.transport for p in peers if p.transport is not None]
