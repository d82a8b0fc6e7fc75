"""The scheduler side of the connector: which requests load remote KV, and P's leases.

P: request_finished keeps the finished request's blocks (delay_free), mints its lease token
and returns the params a router copies to D, all without a network call (this is vLLM's
engine thread: a call here would stall every request's step); the metadata tells each
worker to lease the blocks on its own server, in process. For a request that ends with its
prompt (one output token, as routers ask of P) the lease is ordered in the very step that
completes the prompt, so it exists before the params are handed out; otherwise (or if the
blocks changed meanwhile) in the next step. The params say lease_pending, so a D that
claims before the lease is made waits for it.
P, streamed (a router sent the request to D at once: streams.py): the lease is opened as the
request arrives and committed chunk by chunk from each step's schedule.
D: requests with kvsvc params report their prompt as loadable asynchronously; the
blocks vLLM allocates for them go to the workers in the step's metadata. Until then (a
request can wait in D's queue for a long time when its KV cache is full) their P leases
are kept alive: the metadata tells rank 0's worker when such a request arrives and when
it stops waiting, and the worker heartbeats the waiting ones on its own timer (not on
D's steps, which can take longer than a lease on a loaded host), off this thread.
"""

from __future__ import annotations

import logging
from typing import Any

from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm import stream_params
from kvsvc.integrations.vllm.layout import kernel_block_ids
from kvsvc.integrations.vllm.metadata import LEASE_HEARTBEAT_S, KvsvcConnectorMetadata, Publish, Receive, ServerInfo
from kvsvc.integrations.vllm.streams import FINISHED_OK, PrefillStreams
from kvsvc.leases.table import new_lease_token

log = logging.getLogger("vllm.kvsvc")  # under vLLM's logger: its handlers and level apply


class KvsvcScheduler:
    def __init__(self, *, engine_id: str, tp_size: int, dcp_size: int, is_producer: bool,
                 lease_ttl_ms: int = 0,
                 lease_heartbeat_s: float = LEASE_HEARTBEAT_S, stream_block_size: int = 0,
                 not_streamable: str = "", stream_groups: int = 1, carries_state: bool = False) -> None:
        """carries_state: the model keeps Mamba state (a hybrid): P leaves the prompt's last
        token to D (leave_last_token), and D reads only a state it can continue from."""
        self.engine_id = engine_id
        self.carries_state = carries_state
        self.tp_size = tp_size
        self.dcp_size = dcp_size
        self.is_producer = is_producer
        self.lease_ttl_ms = lease_ttl_ms
        self._servers: dict[int, ServerInfo] = {}
        self._meta = KvsvcConnectorMetadata()
        self._waiting: set[str] = set()  # D requests parked until their transfer ends
        # D requests with kvsvc params not yet given blocks: their P leases are heartbeated.
        self._queued: set[str] = set()
        self.lease_heartbeat_s = lease_heartbeat_s
        # P: requests that finish with their prompt (one output token, as a router asks of
        # P), their vLLM block ids so far, and the early leases made for them.
        self._prefilling: dict[str, Any] = {}
        self._blocks: dict[str, list[list[int]]] = {}
        self._early: dict[str, Publish] = {}
        # P: requests a router streams to D (progressive pull: streams.py).
        self._streams = PrefillStreams(block_size=stream_block_size, lease_ttl_ms=lease_ttl_ms, groups=stream_groups,
                                       not_streamable=not_streamable or ("" if stream_block_size else
                                                                         "no block size known"))
        # D: streamed requests' local prefix hits (tokens), from the ask to the allocation.
        self._prefix_tokens: dict[str, int] = {}

    # ---- set-up ----------------------------------------------------------------------

    def set_servers(self, metadata: dict[int, Any]) -> None:
        self._servers = {rank: meta for rank, meta in metadata.items() if isinstance(meta, ServerInfo)}
        per_logical = {info.blocks_per_logical for info in self._servers.values()}
        if len(per_logical) == 1:
            self._streams.blocks_per_logical = per_logical.pop()

    def shutdown(self) -> None:
        """Nothing to close: the scheduler side holds no connection (its work is in the metadata)."""

    # ---- D: what to load -------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if self.is_producer and params and params.get("do_remote_decode"):
            if self.carries_state:
                leave_last_token(request, params)
            self._produce(request, params)  # a streamed request's lease opens now, empty
        if kvparams.is_kvsvc(request.kv_transfer_params) and self.lease_heartbeat_s > 0:
            self._queued.add(request.request_id)
            self._meta.keep_alive[request.request_id] = dict(request.kv_transfer_params)

    def _stop_keeping(self, req_id: str) -> None:
        if req_id in self._queued:
            self._queued.discard(req_id)
            if self._meta.keep_alive.pop(req_id, None) is None:  # the worker heard of it: tell it
                self._meta.stop_keep_alive.add(req_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not kvparams.is_kvsvc(params):
            if self.is_producer and params and params.get("do_remote_decode"):
                self._produce(request, params)
            return 0, False
        # Every prompt token P computed: D recomputes nothing of the prompt but what
        # vLLM itself decides to (it always computes the last token for its logits). A
        # streamed request's P computes all of the prompt (it had no answer to tell D how many).
        remote = int(params.get("remote_num_tokens") or 0)
        if stream_params.is_streamed(params):
            remote = remote or request.num_prompt_tokens
            self._prefix_tokens[request.request_id] = num_computed_tokens
        if self.carries_state and not self._state_usable(request, params, remote):
            # D computes the whole prompt: no transfer (one with no local blocks would still
            # need one for the state), and P's lease goes now, not at the end of its TTL.
            self._stop_keeping(request.request_id)
            self._meta.abandon[request.request_id] = dict(params)
            params["do_remote_prefill"] = False
            return 0, False
        count = min(remote, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _state_usable(self, request: Any, params: dict[str, Any], remote: int) -> bool:
        """Whether D can continue from P's Mamba state: a state is of every token P computed,
        so P must have left D at least the last prompt token (leave_last_token), and the
        state's bytes split across TP only as kvsvc's contiguous shards, which vLLM's conv
        state is not: equal TP sizes only. Anything else is recomputed, never read."""
        remote_tp = int((params.get(kvparams.KEY) or {}).get("remote_tp_size") or params.get("tp_size") or 0)
        why = ""
        if remote <= 0:
            why = "P's params give no token count"
        elif remote >= request.num_prompt_tokens:
            why = f"P's state covers {remote} tokens of a {request.num_prompt_tokens}-token prompt (D must compute the last)"
        elif remote_tp != self.tp_size:
            why = f"P runs TP {remote_tp} and D TP {self.tp_size}: kvsvc moves Mamba state between equal TP sizes"
        if why:
            log.warning("kvsvc: %s recomputes its prompt: %s", request.request_id, why)
        return not why

    def _produce(self, request: Any, params: dict[str, Any]) -> None:
        """P: a request a decode engine will continue -- streamed when a router sent it to D
        at once (a stream order), else leased in the step that ends its prompt."""
        rid = request.request_id
        if rid in self._streams or rid in self._prefilling:
            return  # seen already (vLLM asks each step until it schedules the request)
        try:
            order = stream_params.stream_order(params)
        except ValueError as e:
            log.warning("kvsvc: %s is not streamed: %s", rid, e)
            order = None
        one_token = getattr(request, "max_tokens", None) == 1
        if order is not None:
            why_not = "" if one_token else "a streamed request must end with its prompt (max_tokens 1)"
            if len(self._servers) != self.tp_size:
                why_not = why_not or f"kvsvc servers known for ranks {sorted(self._servers)}, TP is {self.tp_size}"
            self._streams.add(request, order, self._meta, why_not)
        elif one_token:
            self._prefilling[rid] = request  # lease it in the step that ends it

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not kvparams.is_kvsvc(params):
            return
        self._stop_keeping(request.request_id)  # its transfer claims (and extends) the lease itself
        # Only the blocks D does not hold already (a prefix hit keeps its hashed blocks).
        local = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else [[] for _ in blocks.blocks]
        awaiting = num_external_tokens > 0
        prefix = self._prefix_tokens.pop(request.request_id, 0)
        self._meta.receive[request.request_id] = Receive(kvparams.block_lists(local), dict(params), awaiting, prefix)
        if awaiting:
            self._waiting.add(request.request_id)
        params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: Any) -> KvsvcConnectorMetadata:
        try:
            self._streams.step(scheduler_output, self._meta)
        except Exception:  # never into vLLM's scheduler
            log.exception("kvsvc: following the streamed requests failed")
        if self._prefilling:
            try:
                self._lease_early(scheduler_output)
            except Exception:  # never into vLLM's scheduler: these requests take the regular path
                log.warning("kvsvc: could not follow the blocks of %d prefills; leasing them after they finish",
                            len(self._prefilling), exc_info=True)
                self._prefilling.clear()
                self._blocks.clear()
        meta, self._meta = self._meta, KvsvcConnectorMetadata()
        return meta

    def _lease_early(self, out: Any) -> None:
        """P: a request whose prompt completes in this step is leased in this step's metadata
        (each worker makes the lease before the forward runs), so the lease exists before
        vLLM hands its params out and D never waits for P's next step. Block ids are followed
        from the step outputs; a request resumed after preemption is left to the regular path."""
        for new in out.scheduled_new_reqs:
            if new.req_id in self._prefilling:
                self._blocks[new.req_id] = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._blocks:
                continue
            if rid in cached.resumed_req_ids:
                self._prefilling.pop(rid, None)
                del self._blocks[rid]
            elif cached.new_block_ids[i]:
                for group, added in zip(self._blocks[rid], cached.new_block_ids[i], strict=True):
                    group.extend(added)
        for rid, scheduled in out.num_scheduled_tokens.items():
            request = self._prefilling.get(rid)
            if request is None or rid not in self._blocks or \
                    request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            del self._prefilling[rid]
            blocks = self._blocks.pop(rid)
            try:
                order = self._order(blocks, int(request.num_prompt_tokens), early=True)
            except Exception as e:  # the regular path says why, if it fails too
                log.debug("kvsvc: no early lease for %s: %s", rid, e)
                continue
            self._early[rid] = self._meta.publish[rid] = order

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._waiting.discard(req_id)

    # ---- both: a finished request ----------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        early = self._early.pop(rid, None)
        self._prefilling.pop(rid, None)
        self._blocks.pop(rid, None)
        self._prefix_tokens.pop(rid, None)
        order = self._streams.order_of(rid)
        if order is not None:  # streamed: kept for its lease (made by the workers), or revoked
            if not self._streams.finished(request, self._meta):
                return False, None
            self._meta.delayed.add(rid)
            return True, self._stream_params(order, int(request.num_prompt_tokens))
        delay, params = self._finished(request, block_ids, early)
        if early is not None and rid not in self._meta.delayed_early:
            self._meta.withdraw[rid] = early.lease_token  # made, but nobody gets its token
        return delay, params

    def _finished(self, request: Any, block_ids: Any, early: Publish | None) -> tuple[bool, dict[str, Any] | None]:
        self._stop_keeping(request.request_id)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if kvparams.is_kvsvc(params):
            # D never scheduled it (aborted while waiting): P's lease must not wait out its TTL.
            self._meta.abandon[request.request_id] = dict(params)
            params["do_remote_prefill"] = False
            return False, None
        if request.request_id in self._waiting:
            self._meta.cancel.add(request.request_id)  # vLLM keeps the blocks until the transfer ends
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status.name not in FINISHED_OK or not any(len(g) for g in block_ids):
            return False, None
        rid = request.request_id
        try:
            order = self._order(block_ids, int(request.num_computed_tokens))
            if early is not None and (early.block_ids, early.num_tokens) == (order.block_ids, order.num_tokens):
                order = early  # leased already, in the step that ended the prompt
                self._meta.delayed_early.add(rid)
            else:
                self._meta.publish[rid] = order  # the workers lease it from the next step
        except Exception as e:  # D then prefills itself; the blocks are freed now
            log.warning("kvsvc: could not lease %s for decode: %s", rid, e)
            return False, None
        self._meta.delayed.add(rid)
        return True, self._params(rid, order)

    def _order(self, block_ids: Any, num_tokens: int, early: bool = False) -> Publish:
        """A lease for the workers to make, with a token minted here (no network call: this
        is vLLM's engine thread)."""
        if len(self._servers) != self.tp_size:
            raise RuntimeError(f"kvsvc servers known for ranks {sorted(self._servers)}, TP is {self.tp_size}")
        per_logical = {info.blocks_per_logical for info in self._servers.values()}
        if len(per_logical) != 1:
            raise RuntimeError(f"workers split vLLM's blocks differently: {sorted(per_logical)}")
        ids = kernel_block_ids(kvparams.block_lists(block_ids), per_logical.pop())
        return Publish(ids, num_tokens, new_lease_token(), self.lease_ttl_ms, early)

    def _stream_params(self, order: stream_params.StreamOrder, num_tokens: int) -> dict[str, Any]:
        """The params of a streamed request's lease (the router gave D its own already; P's
        answer tells the router what P's servers are now)."""
        servers = [(info.address, info.epoch, info.tp_rank) for info in (self._servers[r] for r in range(self.tp_size))]
        params = kvparams.pending_params(engine_id=self.engine_id, request_id=order.lease_id, block_ids=[],
                                         servers=servers, token=order.token, num_tokens=num_tokens,
                                         tp_size=self.tp_size, dcp_size=self.dcp_size)
        params[kvparams.KEY]["progressive"] = True
        return params

    def _params(self, request_id: str, order: Publish) -> dict[str, Any]:
        """The params naming the lease (lease_pending: a D that asks before it exists waits)."""
        servers = [(info.address, info.epoch, info.tp_rank) for info in (self._servers[r] for r in range(self.tp_size))]
        return kvparams.pending_params(engine_id=self.engine_id, request_id=request_id, block_ids=order.block_ids,
                                       servers=servers, token=order.lease_token, num_tokens=order.num_tokens,
                                       tp_size=self.tp_size, dcp_size=self.dcp_size)


def leave_last_token(request: Any, params: dict[str, Any]) -> None:
    """P, for a model with Mamba state: prefill all of the prompt but its last token, so the
    state P leases is of the tokens D loads and D computes the last one from it (a state of
    the whole prompt would take in the last token twice). As vLLM's NixlConnector does;
    once per request (a preempted request comes back with its prompt already cut), never
    to an empty prompt."""
    if params.get(_LEFT_LAST) or request.num_prompt_tokens <= 1 or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params[_LEFT_LAST] = True


_LEFT_LAST = "kvsvc_left_last_token"  # in P's copy of the request's params: cut once
