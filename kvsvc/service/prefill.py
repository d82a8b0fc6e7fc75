"""The P side of the service: answer handshakes, publish leases, take claims and notifications."""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Sequence

import numpy as np

from kvsvc.codec import bad_field, block_ids_to_proto, layout_from_proto, layout_to_proto
from kvsvc.config import Role
from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError, lease_not_yet_made
from kvsvc.layout.compat import compatibility_hash
from kvsvc.layout.kinds import policy_of
from kvsvc.layout.specs import SpecFamily
from kvsvc.leases.table import Lease, LeaseState, NotifyKind, Release, SubscriberBehind, monotonic_to_unix_ms
from kvsvc.limits import (
    MAX_DIGEST_BYTES,
    MAX_TP_SIZE,
    MAX_WAIT_MS,
    MIN_CLAIM_ID_BYTES,
    check_block_lists,
    check_count,
    check_id,
    check_num_tokens,
    check_tp_size,
    too_big,
)
from kvsvc.mapping.dcp import request_blocks
from kvsvc.mapping.geometry import check_block_ids
from kvsvc.mapping.planner import Side, validate_pair
from kvsvc.mapping.topology import tp_ratio
from kvsvc.memory.pools import MemoryKind
from kvsvc.reasons import Reason
from kvsvc.service import content
from kvsvc.service.auth import require_engine, require_peer
from kvsvc.service.node import Node
from kvsvc.service.siblings import Siblings
from kvsvc.v1 import kv_transfer_pb2 as pb

HANDSHAKE_PROGRESS_S = 5.0

LEASE_STATES = {
    LeaseState.OFFERED: pb.LEASE_STATE_OFFERED, LeaseState.CLAIMED: pb.LEASE_STATE_CLAIMED,
    LeaseState.CONSUMED: pb.LEASE_STATE_CONSUMED, LeaseState.EXPIRED: pb.LEASE_STATE_EXPIRED,
    LeaseState.ABORTED: pb.LEASE_STATE_ABORTED,
}
RELEASE_REASONS = {
    LeaseState.CONSUMED: pb.RELEASE_REASON_CONSUMED, LeaseState.EXPIRED: pb.RELEASE_REASON_EXPIRED,
    LeaseState.ABORTED: pb.RELEASE_REASON_ABORTED,
}
NOTIFY_KINDS = {pb.NOTIFY_KIND_CONSUMED: NotifyKind.CONSUMED, pb.NOTIFY_KIND_ABORTED: NotifyKind.ABORTED,
                pb.NOTIFY_KIND_HEARTBEAT: NotifyKind.HEARTBEAT}


def handshake(node: Node, req: pb.HandshakeRequest, peer_names: Sequence[str] = ()) -> pb.HandshakeResponse:
    """Validate the peer (engine, TP, layout) from the reader's side, then hand out rank metadata."""
    node.require_role(Role.PREFILL, "Handshake")
    data = node.require_data_plane("Handshake")
    if not req.engine_id:
        raise bad_field("engine_id", "must be set", Reason.MISSING_FIELD)
    check_id(req.engine_id, "engine_id")
    check_id(req.expected_engine_id, "expected_engine_id")
    require_peer(node, req.engine_id, peer_names, "handshake")
    if req.tp_size == 0:
        raise bad_field("tp_size", "must be positive", Reason.MISSING_FIELD)
    check_tp_size(req.tp_size, "tp_size")
    check_count(req.ranks, "ranks", node.config.tp_size)
    if req.expected_engine_id and req.expected_engine_id != node.config.engine_id:
        raise FailedPrecondition(Reason.UNKNOWN_ENGINE, f"this server hosts engine {node.config.engine_id!r}, not "
                                 f"{req.expected_engine_id!r}; check the address the router handed out",
                                 {"expected_engine_id": req.expected_engine_id, "engine_id": node.config.engine_id})
    tp_ratio(req.tp_size, node.config.tp_size)
    if not req.HasField("layout"):
        raise bad_field("layout", "must be set", Reason.MISSING_FIELD)
    peer_layout = layout_from_proto(req.layout, "layout", req.tp_size)
    computed = compatibility_hash(peer_layout)
    if req.layout_hash and req.layout_hash != computed:
        raise InvalidArgument(Reason.LAYOUT_HASH_MISMATCH, f"layout_hash {req.layout_hash} does not match the layout "
                              f"sent ({computed}): kvsvc versions differ?",
                              {"layout_hash": req.layout_hash, "computed": computed})
    validate_pair(Side.of(peer_layout, req.tp_size), node.side)
    ranks = list(req.ranks) or list(node.hosted_ranks)
    missing = [r for r in ranks if r not in node.hosted_ranks]
    if missing:
        raise FailedPrecondition(Reason.PEER_RANKS_MISSING, f"ranks {missing} are not hosted by this server (hosted: "
                                 f"{list(node.hosted_ranks)}); ask the server of the node that hosts them",
                                 {"ranks": ",".join(map(str, missing))})
    # The reader wires up its UCX endpoints right after this answer; a target that does
    # not progress would stall that, so progress for a while.
    data.need_progress(+1)
    asyncio.get_running_loop().call_later(HANDSHAKE_PROGRESS_S, data.need_progress, -1)
    data.beat_when_idle()  # READs without a claim come later, and need our endpoints alive
    return pb.HandshakeResponse(
        engine_id=node.config.engine_id, epoch=node.epoch, tp_size=node.config.tp_size,
        layout=layout_to_proto(node.layout),
        ranks=[pb.RankHandshake(tp_rank=r, agent_name=data.agent_name(r), agent_metadata=data.metadata(r),
                                regions=node.region_table(r), memory_kind=node.memory_kind(r),
                                device_id=node.pools[r].device_id) for r in ranks],
        lease_socket=node.lease_socket_path, node_id=node.node_id,
    )


def _ttl_s(ms: int) -> float | None:
    return ms / 1000 if ms else None


async def publish(node: Node, req: pb.PublishBlocksRequest, siblings: Siblings) -> pb.PublishBlocksResponse:
    """Lease the blocks here (and, for the engine's own call, on every sibling server)."""
    if req.progressive and not req.lease_token and siblings.known:
        raise InvalidArgument(Reason.INVALID_FIELD, "a progressive lease is not fanned out to sibling servers: open "
                              "it on each server under one lease_token (and commit on each)",
                              {"field": "progressive", "siblings": len(siblings.known)})
    lease, groups = lease_here(node, req)
    taken = content.pending(lease)
    if taken is not None:  # the digests are of the bytes as they are when this answers
        await asyncio.shield(taken)
    servers = [pb.EngineServer(address=node.address, ranks=list(node.hosted_ranks), epoch=node.epoch,
                               lease_serial=lease.serial)]
    if not req.lease_token and siblings.known:  # the engine's own call: the siblings lease their ranks
        try:
            servers += await siblings.publish(req, lease.token)
        except BaseException:
            node.leases.notify(req.request_id, NotifyKind.ABORTED, [], node.epoch, token=lease.token, withdraw=True)
            raise
    params = pb.TransferParams(
        remote_address=node.address, remote_engine_id=node.config.engine_id, remote_request_id=req.request_id,
        remote_block_ids_per_group=block_ids_to_proto(groups), remote_epoch=node.epoch,
        remote_tp_size=node.config.tp_size, lease_token=lease.token, remote_servers=servers,
        remote_dcp_size=node.layout.dcp_size, remote_num_tokens=req.num_tokens, progressive=req.progressive)
    return pb.PublishBlocksResponse(params=params, lease_expires_unix_ms=monotonic_to_unix_ms(lease.expires_at))


def lease_here(node: Node, req: pb.PublishBlocksRequest) -> tuple[Lease, list[list[int]]]:
    """Check a publish and lease its blocks on this server alone, at once (no await: an engine
    embedding the server calls it on the server's loop, in order with its other work)."""
    node.require_role(Role.PREFILL, "PublishBlocks")
    node.require_data_plane("PublishBlocks")
    check_id(req.request_id, "request_id")
    check_id(req.lease_token, "lease_token")
    groups = checked_groups(node, req.block_ids_per_group)
    if req.progressive:
        check_progressive(node)
        check_growing_blocks(node, groups)
        check_num_tokens(req.num_tokens, "num_tokens")  # blocks cover the tokens once final
    else:
        check_blocks_cover(node, req.num_tokens, groups)
    # Counted per lease asked for, made or refused (one D gave up on before it was made), so
    # that the n-th lease is the engine's n-th request.
    fault = node.faults.next_lease() if node.faults is not None else None
    lease = node.leases.publish(req.request_id, groups, _ttl_s(req.lease_ttl_ms), token=req.lease_token,
                                num_tokens=req.num_tokens, progressive=req.progressive)
    content.take(node, lease, now=fault == "block_rewritten")  # digests before that fault rewrites
    if fault is not None:
        lease.fault = fault
        rewrite_if_faulted(node, lease)
    return lease, groups


def checked_groups(node: Node, block_ids_per_group: Sequence[pb.BlockIds]) -> list[list[int]]:
    """Block ids from an engine, one list per group of this server's layout, each in its pool."""
    check_block_lists([g.block_ids for g in block_ids_per_group], "block_ids_per_group")
    groups = [list(g.block_ids) for g in block_ids_per_group]
    if len(groups) != len(node.layout.groups):
        raise InvalidArgument(Reason.UNKNOWN_GROUP, f"block ids name {len(groups)} groups but the layout has "
                              f"{len(node.layout.groups)}", {"given_groups": len(groups),
                                                             "layout_groups": len(node.layout.groups)})
    for g, ids in enumerate(groups):
        check_block_ids(np.asarray(ids, np.int64), node.layout.group_blocks(g), side="local", group=g)
    return groups


def check_progressive(node: Node) -> None:
    """What a progressive lease does not go with yet (docs/ARCHITECTURE.md, "Progressive pull")."""
    if node.layout.dcp_size > 1:
        raise FailedPrecondition(Reason.LEASE_NOT_PROGRESSIVE, f"this engine runs DCP {node.layout.dcp_size}, which "
                                 "progressive leases do not take yet: lease the request whole",
                                 {"dcp_size": node.layout.dcp_size})


def check_growing_blocks(node: Node, groups: list[list[int]]) -> None:
    """Blocks opened or committed before a progressive lease's final commit: no SSM state,
    which the engine rewrites every chunk (committed, it would be read half-made)."""
    for g, group in enumerate(node.layout.groups):
        if group.family is SpecFamily.SSM and groups[g]:
            raise bad_field(f"block_ids_per_group[{g}]", "is an SSM state, which the engine rewrites every chunk: "
                            "put it in the final commit only", Reason.INVALID_FIELD)


def check_blocks_cover(node: Node, num_tokens: int, groups: list[list[int]]) -> None:
    """A DCP engine must say how long the request is; a length must fit the blocks published."""
    check_num_tokens(num_tokens, "num_tokens")
    dcp = node.layout.dcp_size
    if not num_tokens:
        if dcp > 1:
            raise bad_field("num_tokens", f"must be set: this engine deals each request's blocks over {dcp} DCP "
                            "ranks, and D needs to know where the real ones end", Reason.NUM_TOKENS_REQUIRED)
        return
    needed = -(-request_blocks(num_tokens, node.layout.block_size) // dcp)
    for g, (group, ids) in enumerate(zip(node.layout.groups, groups, strict=True)):
        if policy_of(group.spec_type).blocks_cover_tokens and len(ids) < needed:
            raise InvalidArgument(
                Reason.BLOCK_COUNT_MISMATCH, f"group {g}: {num_tokens} tokens need {needed} block ids per rank (block size "
                f"{node.layout.block_size}, DCP {dcp}), got {len(ids)}",
                {"group": g, "block_ids": len(ids), "needed": needed, "num_tokens": num_tokens})


async def claim_when_made(node: Node, req: pb.ClaimLeaseRequest,
                          peer_names: Sequence[str] = ()) -> pb.ClaimLeaseResponse:
    """claim(), holding a claim for a lease not made yet up to req.wait_ms for its publish
    (leases/arrivals.py): one call where D used to ask every few ms."""
    deadline = time.monotonic() + req.wait_ms / 1000
    while True:
        try:
            return await content.answer(*claimed(node, req, peer_names), req=req)
        except KvsvcError as e:
            left = deadline - time.monotonic()
            if not lease_not_yet_made(e) or left <= 0:
                raise
        await node.leases.arrivals.wait(req.request_id, req.engine_id, left)


def claim(node: Node, req: pb.ClaimLeaseRequest, peer_names: Sequence[str] = ()) -> pb.ClaimLeaseResponse:
    """A claim answered now (wait_ms and want_content are claim_when_made's)."""
    return claimed(node, req, peer_names)[1]


def claimed(node: Node, req: pb.ClaimLeaseRequest,
            peer_names: Sequence[str] = ()) -> tuple[Lease | None, pb.ClaimLeaseResponse]:
    """The lease a claim found (None: consumed before, by this claim's retry) and its answer."""
    node.require_role(Role.PREFILL, "ClaimLease")
    require_peer(node, req.engine_id, peer_names, "claim leases")
    check_lease_ids(req)
    if req.tp_size == 0:
        raise bad_field("tp_size", "must be positive", Reason.MISSING_FIELD)
    check_tp_size(req.tp_size, "tp_size")
    check_count(req.ranks, "ranks", req.tp_size)
    if len(req.claim_id.encode()) < MIN_CLAIM_ID_BYTES:
        raise bad_field("claim_id", f"must be a fresh secret of at least {MIN_CLAIM_ID_BYTES} characters",
                        Reason.MISSING_FIELD)
    if len(req.blocks_digest) > MAX_DIGEST_BYTES:
        raise too_big("blocks_digest", len(req.blocks_digest), MAX_DIGEST_BYTES, "bytes")
    if req.wait_ms > MAX_WAIT_MS:
        raise too_big("wait_ms", req.wait_ms, MAX_WAIT_MS, "ms")
    if node.faults is not None:
        _release_if_faulted(node, req.request_id)
    d_dcp = req.dcp_size or 1
    if d_dcp not in (1, req.tp_size):
        raise bad_field("dcp_size", f"is {d_dcp} but must be 1 or the D TP size {req.tp_size}", Reason.INVALID_DCP_SIZE)
    lease: Lease | None = node.leases.claim(req.request_id, req.lease_epoch, token=req.lease_token, claim_id=req.claim_id,
                                     d_engine_id=req.engine_id, d_tp_size=req.tp_size, d_ranks=list(req.ranks),
                                     extend_s=_ttl_s(req.extend_ms), d_dcp_size=d_dcp, consumed=req.consumed,
                                     digest=req.blocks_digest, serial=req.lease_serial)
    if lease is None or lease.state.released:  # None: this claim consumed it before (a retry)
        return lease, pb.ClaimLeaseResponse(state=pb.LEASE_STATE_CONSUMED)
    return lease, pb.ClaimLeaseResponse(lease_expires_unix_ms=monotonic_to_unix_ms(lease.expires_at),
                                        lease_remaining_ms=max(0, int((lease.expires_at - time.monotonic()) * 1000)),
                                        state=pb.LEASE_STATE_CLAIMED)


# ---- injected faults (service/faults.py: tests only) ---------------------------------------

def rewrite_if_faulted(node: Node, lease: Lease) -> None:
    """block_rewritten (lease_released is applied when D claims): the engine writes into a
    leased block after its digest was taken, before D reads it -- as an engine that reuses a
    leased block. A lease made whole: its first block, as it is made. A progressive lease:
    the first block of group 0 a commit made whole and had hashed (a server without
    content_digest hashes none: not applied), once."""
    if lease.fault != "block_rewritten":
        return
    assert node.faults is not None
    target = lease.block_ids[0][:1].tolist() if lease.commits is None else (content.newly_whole(lease) or [])[:1]
    if not target:
        return
    lease.fault = ""
    node.faults.injected_now("block_rewritten")
    for rank in node.hosted_ranks:
        pool = node.pools[rank]
        if pool.memory_kind is not MemoryKind.DRAM:
            continue
        region = next(r for r in node.side.pool.regions if r.group_index == 0)
        at = pool.region_address(region) + target[0] * region.block_stride
        block = (ctypes.c_ubyte * min(64, region.block_len)).from_address(at)
        for i in range(len(block)):
            block[i] ^= 0xFF


def _release_if_faulted(node: Node, request_id: str) -> None:
    """lease_released: the lease is aborted (as a router's abort or an expiry would end it)
    just before D's claim reaches it."""
    assert node.faults is not None
    for lease in node.leases.lookup([request_id]):
        if lease.fault == "lease_released":
            lease.fault = ""
            node.faults.injected_now("lease_released")
            node.leases.notify(lease.request_id, NotifyKind.ABORTED, [], node.epoch, token=lease.token)


def check_lease_ids(req: pb.ClaimLeaseRequest | pb.NotifyRequest | pb.WaitCommitRequest) -> None:
    """The ids a D's lease call names: request id and epoch set, each id within its limits."""
    if not req.request_id:
        raise bad_field("request_id", "must be set (the P-side request id)", Reason.MISSING_FIELD)
    if not req.lease_epoch:
        raise bad_field("lease_epoch", "must be set (TransferParams.remote_epoch)", Reason.MISSING_FIELD)
    for name in ("request_id", "engine_id", "lease_token", "claim_id"):
        if name in req.DESCRIPTOR.fields_by_name:
            check_id(getattr(req, name), name)


def notify(node: Node, req: pb.NotifyRequest, peer_names: Sequence[str] = ()) -> pb.NotifyResponse:
    node.require_role(Role.PREFILL, "Notify")
    if req.withdraw:  # the engine's own servers take back a failed publish
        require_engine(node, peer_names, "withdraw leases")
    else:
        require_peer(node, req.engine_id, peer_names, "notify")
    check_lease_ids(req)
    if req.kind not in NOTIFY_KINDS:
        raise bad_field("kind", "NotifyKind must be set (NOTIFY_KIND_UNSPECIFIED is rejected)", Reason.UNSPECIFIED_ENUM,
                        value=req.kind)
    check_count(req.done_ranks, "done_ranks", MAX_TP_SIZE)
    state, pending = node.leases.notify(req.request_id, NOTIFY_KINDS[req.kind], list(req.done_ranks),
                                        req.lease_epoch, token=req.lease_token, claim_id=req.claim_id,
                                        withdraw=req.withdraw)
    lease = node.leases.get(req.request_id)
    remaining = lease.expires_at - time.monotonic() if lease is not None and state and not state.released else 0.0
    return pb.NotifyResponse(state=LEASE_STATES.get(state, pb.LEASE_STATE_UNKNOWN) if state else
                             pb.LEASE_STATE_UNKNOWN, pending_ranks=pending,
                             lease_remaining_ms=max(0, int(remaining * 1000)))


def release_to_proto(ev: Release) -> pb.WatchReleasesResponse:
    return pb.WatchReleasesResponse(request_id=ev.request_id, reason=RELEASE_REASONS[ev.reason],
                                    block_ids_per_group=block_ids_to_proto(ev.block_ids),
                                    released_unix_ms=ev.released_unix_ms,
                                    free_block_ids_per_group=block_ids_to_proto(ev.free_block_ids))


def watch_behind(e: SubscriberBehind) -> KvsvcError:
    """How a subscriber that fell behind is ended, with what to do about it."""
    return KvsvcError(Reason.WATCH_BEHIND, "this WatchReleases stream was not read while its releases piled up "
                      f"({e.held_bytes} bytes, limit {e.limit_bytes}); they were dropped. Subscribe again, and "
                      "once its headers came, reconcile: look the requests you published up by exact id (ListLeases "
                      "request_ids); one whose lease it does not list was released (free its blocks that no listed "
                      "lease holds)",
                      {"held_bytes": e.held_bytes, "limit_bytes": e.limit_bytes}, code=ErrorCode.RESOURCE_EXHAUSTED)
