"""ListLeases: what an operator may see of a server's leases, peers and transfers (read only)."""

from __future__ import annotations

import time

from kvsvc.leases.table import Lease
from kvsvc.limits import DEFAULT_LIST_LEASES, MAX_LIST_LEASES, check_count, check_id, too_big
from kvsvc.service.decode import Decoder
from kvsvc.service.node import Node
from kvsvc.service.peers import Peer
from kvsvc.service.prefill import LEASE_STATES
from kvsvc.v1 import kv_transfer_pb2 as pb


def _lease_info(lease: Lease, now: float, now_unix_ms: int) -> pb.LeaseInfo:
    remaining_ms = max(0, int((lease.expires_at - now) * 1000))
    return pb.LeaseInfo(
        request_id=lease.request_id, state=LEASE_STATES[lease.state], published_unix_ms=lease.published_unix_ms,
        expires_unix_ms=now_unix_ms + remaining_ms, remaining_ms=remaining_ms,
        num_blocks=sum(len(g) for g in lease.block_ids), claimed_by_engine_id=lease.d_engine_id,
        claimed_by_tp_size=lease.d_tp_size, num_claims=len(lease.claims),
        pending_d_ranks=lease.tracker.pending_d_ranks if lease.tracker else [])


def _peer_info(peer: Peer) -> pb.PeerInfo:
    return pb.PeerInfo(address=peer.address, engine_id=peer.engine_id, epoch=peer.epoch, tp_size=peer.tp_size,
                       transfers_using=peer.users, lease_channel_open=peer.lease is not None and peer.lease.is_open,
                       lease_carrier=peer.lease.carrier if peer.lease is not None else "grpc")


def list_leases(node: Node, decoder: Decoder, req: pb.ListLeasesRequest) -> pb.ListLeasesResponse:
    if req.limit > MAX_LIST_LEASES:
        raise too_big("limit", req.limit, MAX_LIST_LEASES, "leases")
    check_id(req.request_id_prefix, "request_id_prefix")
    check_count(req.request_ids, "request_ids", MAX_LIST_LEASES)
    for i, rid in enumerate(req.request_ids):
        check_id(rid, f"request_ids[{i}]")
    now, now_unix_ms = time.monotonic(), int(time.time() * 1000)
    if req.request_ids:  # a lookup by exact id: every live one asked for
        leases = [x for x in node.leases.lookup(req.request_ids) if x.request_id.startswith(req.request_id_prefix)]
    else:
        leases = node.leases.listing(req.limit or DEFAULT_LIST_LEASES, req.request_id_prefix)
    return pb.ListLeasesResponse(
        leases=[_lease_info(lease, now, now_unix_ms) for lease in leases], live_leases=node.leases.live_count,
        claimed_leases=node.leases.claimed_count, peers=[_peer_info(p) for p in decoder.peers.listing()],
        running_transfers=decoder.jobs.running)
