"""The P side of progressive leases (docs/ARCHITECTURE.md, "Progressive pull"): the engine's
commits, and D's waits for the next one. The state and its rules are the lease table's
(leases/table.py, leases/commits.py); this checks the calls and speaks protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence

from kvsvc.codec import bad_field, block_ids_to_proto
from kvsvc.config import Role
from kvsvc.leases.records import Lease
from kvsvc.leases.table import monotonic_to_unix_ms
from kvsvc.limits import MAX_WAIT_MS, MIN_CLAIM_ID_BYTES, check_id, check_num_tokens, too_big
from kvsvc.reasons import Reason
from kvsvc.service import content
from kvsvc.service.auth import require_peer
from kvsvc.service.node import Node
from kvsvc.service.prefill import (
    check_blocks_cover,
    check_growing_blocks,
    check_lease_ids,
    checked_groups,
    rewrite_if_faulted,
)
from kvsvc.v1 import kv_transfer_pb2 as pb


def commit(node: Node, req: pb.CommitBlocksRequest) -> pb.CommitBlocksResponse:
    """The engine's next chunk (the caller is the engine: checked by the servicer)."""
    node.require_role(Role.PREFILL, "CommitBlocks")
    if not req.request_id:
        raise bad_field("request_id", "must be set (the P-side request id)", Reason.MISSING_FIELD)
    check_id(req.request_id, "request_id")
    check_id(req.lease_token, "lease_token")
    if not req.commit_epoch:
        raise bad_field("commit_epoch", "must be set (the next epoch; the opening publish was 1)",
                        Reason.MISSING_FIELD)
    groups = checked_groups(node, req.block_ids_per_group)
    if not req.final:
        check_growing_blocks(node, groups)
    check_num_tokens(req.num_tokens, "num_tokens")
    layers = _checked_layers(node, req.layers_done)
    lease = node.leases.get(req.request_id)
    if lease is not None and lease.fault == "stream_stalled" and lease.commits is not None \
            and lease.commits.epoch >= 2 and secrets.compare_digest(lease.token, req.lease_token):
        return _stalled(node, lease, req)
    if req.final and lease is not None:  # the whole lease must cover its tokens, as a lease made whole does
        check_blocks_cover(node, req.num_tokens, [[*held.tolist(), *more]
                                                  for held, more in zip(lease.block_ids, groups, strict=True)])
    lease = node.leases.commit(req.request_id, node.epoch, token=req.lease_token, commit_epoch=req.commit_epoch,
                               block_ids=groups, num_tokens=req.num_tokens, final=req.final, layers=layers)
    assert lease.commits is not None
    content.take(node, lease, now=lease.fault == "block_rewritten")  # what this commit made whole (content_digest)
    rewrite_if_faulted(node, lease)
    node.metrics.committed(req.final)
    return pb.CommitBlocksResponse(commit_epoch=lease.commits.epoch,
                                   lease_expires_unix_ms=monotonic_to_unix_ms(lease.expires_at))


def _checked_layers(node: Node, layers_done: Sequence[int]) -> tuple[int, ...]:
    """A commit layer by layer's counts: one per group, each at most the group's layers."""
    if not layers_done:
        return ()
    groups = node.layout.groups
    if len(layers_done) != len(groups):
        raise bad_field("layers_done", f"names {len(layers_done)} groups, the layout has {len(groups)}",
                        Reason.UNKNOWN_GROUP, groups=len(layers_done), layout_groups=len(groups))
    for g, (n, group) in enumerate(zip(layers_done, groups, strict=True)):
        have = group.num_layers
        if n > have:
            raise bad_field("layers_done", f"group {g} has {have} layers, not {n}", Reason.INVALID_FIELD,
                            group=g, layers_done=n, layers=have)
    return tuple(int(n) for n in layers_done)


async def commit_answered(node: Node, req: pb.CommitBlocksRequest) -> pb.CommitBlocksResponse:
    """CommitBlocks over the wire: answered once the digests of the blocks it made whole
    were taken (content_digest), as PublishBlocks is -- bytes the engine changes after the
    answer differ from them. An engine embedding the server commits without waiting."""
    resp = commit(node, req)
    taken = content.pending(node.leases.get(req.request_id))
    if taken is not None:
        await asyncio.shield(taken)
    return resp


async def wait_commit(node: Node, req: pb.WaitCommitRequest, peer_names: Sequence[str] = ()) -> pb.WaitCommitResponse:
    """What the lease committed after req.after_epoch, waiting up to req.wait_ms for it."""
    node.require_role(Role.PREFILL, "WaitCommit")
    require_peer(node, req.engine_id, peer_names, "wait for commits")
    check_lease_ids(req)
    if len(req.claim_id.encode()) < MIN_CLAIM_ID_BYTES:
        raise bad_field("claim_id", "must be the claim this D holds on the lease (ClaimLeaseRequest.claim_id)",
                        Reason.MISSING_FIELD)
    if req.wait_ms > MAX_WAIT_MS:
        raise too_big("wait_ms", req.wait_ms, MAX_WAIT_MS, "ms")
    if node.faults is not None and req.after_epoch >= 1:  # (tests only: no lookup in production)
        faulted = node.leases.get(req.request_id)
        if faulted is not None and faulted.fault == "wait_unanswered":
            await _unanswered(node, faulted)
    lease, seen, since = await node.leases.wait_commit(req.request_id, req.lease_epoch, claim_id=req.claim_id,
                                                       d_engine_id=req.engine_id, after_epoch=req.after_epoch,
                                                       timeout_s=req.wait_ms / 1000, reads_done=req.reads_done,
                                                       layers=req.reads_layers)
    commits = lease.commits
    assert commits is not None
    blocks = [held[start:end] for held, (start, end) in zip(lease.block_ids, since, strict=True)]
    partial = req.reads_layers and bool(commits.layers_done)
    resp = pb.WaitCommitResponse(commit_epoch=seen, final=commits.final, block_ids_per_group=block_ids_to_proto(blocks),
                                 num_tokens=commits.num_tokens if partial else commits.whole_tokens,
                                 lease_remaining_ms=max(0, int((lease.expires_at - time.monotonic()) * 1000)))
    if partial:  # (a D that does not read chunks layer by layer sees none until it is whole)
        resp.partial.CopyFrom(pb.PartialChunk(blocks=commits.partial, layers_done=commits.layers_done,
                                              whole_num_tokens=commits.whole_tokens))
    if req.want_content:  # the answer is this epoch's, whatever is committed while the digests are awaited
        resp.content.extend(await content.since(lease, req.after_epoch, resp.commit_epoch))
    return resp


# ---- injected faults (service/faults.py: tests only) ---------------------------------------

async def _unanswered(node: Node, lease: Lease) -> None:
    """wait_unanswered, once a lease: this wait is not answered while the lease lives; the
    call ends at the caller's deadline (grpc cancels it here), as a wait on a stalled P does
    (a caller with no deadline is answered once the lease's time is up)."""
    assert node.faults is not None
    lease.fault = ""
    node.faults.injected_now("wait_unanswered")
    with contextlib.suppress(TimeoutError):  # set by nobody: the call's cancellation or the lease's end
        await asyncio.wait_for(asyncio.Event().wait(), max(0.0, lease.expires_at - time.monotonic()))


def _stalled(node: Node, lease: Lease, req: pb.CommitBlocksRequest) -> pb.CommitBlocksResponse:
    """stream_stalled: the lease keeps its first chunk; this later commit is answered as made
    and dropped (each counted), as if P's engine had hung before computing it."""
    assert node.faults is not None
    node.faults.injected_now("stream_stalled")
    return pb.CommitBlocksResponse(commit_epoch=req.commit_epoch,
                                   lease_expires_unix_ms=monotonic_to_unix_ms(lease.expires_at))
