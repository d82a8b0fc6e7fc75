"""P's streamed requests (progressive pull): which chunk each step's forward computes.

A request whose kv_transfer_params carry a stream order (stream_params.py: a router sent
it to P and D together) is leased under the router's lease id and token. Its lease is opened
empty as soon as vLLM takes the request in (epoch 1, before the next forward), so a D that
came with it claims it at once and waits on P for chunks, however long the request queues
on P. Each step that schedules part of its prompt orders a Commit in the step's metadata:
the blocks that step completes, committed by every worker after the forward (the one that
completes the prompt is final). A request whose blocks vLLM frees before its lease is
done -- preempted, aborted, or finished otherwise -- has its lease revoked before the next
forward can overwrite them: a D reading it then fails typed and uses nothing it read.

Runs on vLLM's engine thread: no network call, no lock, nothing that waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.vllm.layout import kernel_block_ids
from kvsvc.integrations.vllm.metadata import Commit, KvsvcConnectorMetadata
from kvsvc.integrations.vllm.stream_params import StreamOrder

log = logging.getLogger("vllm.kvsvc")

FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass
class _Stream:
    order: StreamOrder
    request: Any
    blocks: list[list[int]] | None = None  # vLLM's block ids per group, as scheduled so far
    sent: int = 0  # vLLM blocks (of each group) committed
    epoch: int = 0  # the lease's commit epoch once the last ordered commit is made (1: opened, empty)
    final: bool = False  # the commit completing the prompt was ordered
    lost: str = ""  # why the request is not streamed any more ("" while it is)


class PrefillStreams:
    def __init__(self, *, block_size: int, not_streamable: str, lease_ttl_ms: int, groups: int = 1) -> None:
        self.block_size = block_size  # vLLM's block, in tokens (every group has the same)
        self.groups = groups  # KV cache groups: an empty opening names each
        self.not_streamable = not_streamable  # why this engine cannot stream ("" when it can)
        self.lease_ttl_ms = lease_ttl_ms
        self.blocks_per_logical = 1  # kernel blocks in one of vLLM's blocks (set with the servers)
        self._streams: dict[str, _Stream] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._streams

    def add(self, request: Any, order: StreamOrder, meta: KvsvcConnectorMetadata, why_not: str = "") -> None:
        """A new streamed request: its lease is opened, empty, by the next step's workers (again:
        nothing; vLLM asks each step until it schedules it)."""
        if request.request_id in self._streams:
            return
        self._streams[request.request_id] = _Stream(order, request, epoch=1)
        why_not = why_not or self.not_streamable
        if why_not:
            self._lose(request.request_id, why_not, meta)
            return
        meta.open[request.request_id] = Commit(order.lease_id, order.token, 1, [[] for _ in range(self.groups)], 0,
                                               False, self.lease_ttl_ms)

    def step(self, out: Any, meta: KvsvcConnectorMetadata) -> None:
        """Follow this step's schedule: blocks added, requests preempted, chunks computed."""
        if not self._streams:
            return
        for rid in getattr(out, "preempted_req_ids", None) or ():
            self._lose(rid, "preempted on P", meta)
        for new in out.scheduled_new_reqs:
            s = self._live(new.req_id)
            if s is not None:
                s.blocks = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s = self._live(rid)
            if s is None:
                continue
            if rid in cached.resumed_req_ids or s.blocks is None:
                self._lose(rid, "resumed after preemption", meta)
            elif cached.new_block_ids[i]:
                for group, added in zip(s.blocks, cached.new_block_ids[i], strict=True):
                    group.extend(added)
        for rid, scheduled in out.num_scheduled_tokens.items():
            s = self._live(rid)
            if s is not None and s.blocks is not None and not s.final:
                self._commit(rid, s, int(scheduled), meta)

    def _commit(self, rid: str, s: _Stream, scheduled: int, meta: KvsvcConnectorMetadata) -> None:
        prompt = int(s.request.num_prompt_tokens)
        done = min(int(s.request.num_computed_tokens) + scheduled, prompt)
        need = -(-done // self.block_size)
        if any(len(g) < need for g in s.blocks or ()):
            self._lose(rid, f"vLLM's blocks do not cover {done} tokens", meta)
            return
        new = kernel_block_ids([g[s.sent:need] for g in s.blocks or ()], self.blocks_per_logical)
        s.final = done >= prompt
        s.epoch += 1
        meta.commit[rid] = Commit(s.order.lease_id, s.order.token, s.epoch, new, done, s.final, self.lease_ttl_ms)
        s.sent = need

    def finished(self, request: Any, meta: KvsvcConnectorMetadata) -> bool:
        """request_finished for a streamed request: True when vLLM must keep its blocks until
        the lease ends (its final chunk was ordered and it finished as asked); False when its
        lease is revoked (or was)."""
        rid = request.request_id
        s = self._streams.pop(rid)
        if s.lost:
            return False
        if s.final and request.status.name in FINISHED_OK:
            return True
        self._revoke(rid, s, meta, f"finished {request.status.name} before its last chunk was committed"
                     if not s.final else f"finished {request.status.name}")
        return False

    def order_of(self, req_id: str) -> StreamOrder | None:
        s = self._streams.get(req_id)
        return None if s is None else s.order

    def _live(self, rid: str) -> _Stream | None:
        s = self._streams.get(rid)
        return s if s is not None and not s.lost else None

    def _lose(self, rid: str, why: str, meta: KvsvcConnectorMetadata) -> None:
        s = self._streams.get(rid)
        if s is None or s.lost:
            return
        s.lost = why
        self._revoke(rid, s, meta, why)

    @staticmethod
    def _revoke(rid: str, s: _Stream, meta: KvsvcConnectorMetadata, why: str) -> None:
        log.info("kvsvc: %s is not streamed any more (%s): its lease %s is taken back", rid, why, s.order.lease_id)
        meta.commit.pop(rid, None)
        meta.open.pop(rid, None)
        meta.revoke[rid] = (s.order.lease_id, s.order.token)
