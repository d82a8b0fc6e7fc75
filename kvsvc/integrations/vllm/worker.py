"""The worker side of the connector: an embedded kvsvc server per worker, and D's transfers.

Each vLLM worker (one TP rank) runs a kvsvc server on its own thread and event loop,
handed the worker's KV tensors in place; a TP-N engine is an engine over N servers.
D: each request in the step's metadata becomes a Transfer on this worker's server (its
rank's reads), run on the server's loop while the model keeps stepping. P: the step's
metadata names the leases to make (under tokens the scheduler minted) and to take back;
the worker makes them on its own server, in process, on the server's loop
(service/in_process.py's InProcessLeases); its release stream, in process too, says when
D is done with a request's blocks (consumed, expired or aborted); vLLM frees them once
every worker reported it. A streamed request (streams.py) is committed chunk by chunk after
each step's forward, and revoked before a forward that may overwrite its blocks; P's steps
run on the loop through one queue, in order (a commit may wait for the device first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.client.leases import LEASE_NOT_YET_MADE, heartbeat_is_transient, heartbeat_published, servers_of
from kvsvc.config import Role, load_config
from kvsvc.errors import KvsvcError
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.embedded import EmbeddedServer
from kvsvc.integrations.loop import LoopThread
from kvsvc.integrations.settings import EngineSettings
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.layer_commits import LayerCommits, PartialCommit
from kvsvc.integrations.vllm.layout import kernel_block_ids
from kvsvc.integrations.vllm.metadata import (
    LEASE_HEARTBEAT_S,
    Commit,
    KvsvcConnectorMetadata,
    Publish,
    Receive,
    ServerInfo,
)
from kvsvc.integrations.vllm.stats import RELEASES_COUNTED, KvsvcConnectorStats
from kvsvc.integrations.vllm.stream_params import is_streamed
from kvsvc.leases.table import LeaseState
from kvsvc.service.in_process import InProcessLeases
from kvsvc.service.server import RunningServer
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("vllm.kvsvc")  # under vLLM's logger: its handlers and level apply

DEFAULTS = EngineSettings()  # a load's deadlines, when none are given

# Far more requests than can finish within any lease's lifetime.
FINISHED_REMEMBERED = 1 << 18
# A revoke runs before the forward that may overwrite the blocks: the engine waits for it,
# and stops (rather than serve bytes a D may still be reading) if the server's loop never runs it.
REVOKE_TIMEOUT_S = 300.0
# Heartbeat answers that leave a waiting request's lease worth keeping (P's params can be
# handed out a step before P's workers make the lease: it may not exist yet).
KEPT = ("LEASE_STATE_OFFERED", LEASE_NOT_YET_MADE)


def log_under_vllm() -> None:
    """The embedded server's own log lines (kvsvc.*) go where vLLM's go, at vLLM's level."""
    ours, theirs = logging.getLogger("kvsvc"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level)
        ours.propagate = False


class KvsvcWorker:
    def __init__(self, *, engine_id: str, role: Role, tp_rank: int, tp_size: int, listen_host: str = "127.0.0.1",
                 advertise_host: str | None = None, server_overrides: dict[str, Any] | None = None,
                 client_options: ClientOptions | None = None, heartbeat_s: float = LEASE_HEARTBEAT_S,
                 listen_port: int = 0, timeout_for: Callable[[bool], float] = DEFAULTS.timeout_for,
                 config_path: str | None = None) -> None:
        self.engine_id, self.role, self.tp_rank, self.tp_size = engine_id, role, tp_rank, tp_size
        self._listen_host, self._advertise_host = listen_host, advertise_host or listen_host
        self._listen_port = listen_port
        self._overrides = dict(server_overrides or {})
        self._config_path = config_path  # a kvsvc TOML whose [server] keys apply (overrides win)
        self._timeout_for = timeout_for  # a load's deadline: streamed (True) or pulled
        self._options = client_options
        # This rank's server, on its own loop thread: P's leases and their releases, D's
        # transfers as calls on that loop (integrations/embedded.py).
        self._embedded: EmbeddedServer | None = None
        self.info: ServerInfo | None = None
        self._blocks_per_logical = 1  # kernel blocks (kvsvc's blocks) in one of vLLM's blocks
        # Rank 0: P leases of the requests waiting in D's queue, heartbeated on the loop.
        self._heartbeat_s = heartbeat_s
        self.heartbeat_rounds_short = 0  # rounds in which some lease was not answered "kept" (tests)
        self._kept: dict[str, pb.TransferParams] = {}
        self._keeper: asyncio.Future[None] | None = None
        self._beat_now = asyncio.Event()
        self._heartbeat_channels: dict[str, AsyncClient] = {}  # P server address -> kept channel (on the loop)
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future[Any]] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._settled_at: dict[str, float] = {}  # loads ended, not yet reported to vLLM: when
        # P: leases kvsvc released, and the requests whose blocks vLLM keeps for them (the
        # scheduler's word, in the metadata); a request is reported finished sending once it
        # is in both. Bounded, oldest dropped: most releases of requests vLLM did not delay
        # never match (a publish that timed out on the scheduler but was applied).
        self._released: OrderedDict[str, None] = OrderedDict()
        self._delayed: OrderedDict[str, None] = OrderedDict()
        self._early_failed: OrderedDict[str, None] = OrderedDict()  # early leases refused (on the loop)
        # P, on the loop: streamed requests' leases (lease id <-> vLLM's request id), from their
        # opening until released or revoked, and the queue P's steps run through, in order.
        self._stream_rid: dict[str, str] = {}
        self._layer_commits: LayerCommits | None = None  # P: the last chunk layer by layer (stream_layers)
        self._stream_lease: dict[str, str] = {}
        self._p_jobs: asyncio.Queue[tuple[Callable[[], Awaitable[None]], concurrent.futures.Future[None] | None]] | None = None
        self._p_runner: asyncio.Future[None] | None = None
        self._stopping = False
        self._stats = KvsvcConnectorStats()  # since vLLM last took them
        # Since start, for whoever asks (vLLM takes the stats above every step).
        self._totals = {"loaded": 0, "failed": 0, "cancelled": 0, "bytes": 0}

    # ---- set-up ----------------------------------------------------------------------

    def start(self, description: CacheDescription) -> ServerInfo:
        log_under_vllm()
        port = self._listen_port + self.tp_rank if self._listen_port else 0  # fixed: base + rank
        config = load_config(self._config_path, listen=f"{self._listen_host}:{port}", engine_id=self.engine_id, role=self.role,
                             tp_size=self.tp_size, ranks=[self.tp_rank], engine_layout=description.layout,
                             **self._overrides)

        embedded = EmbeddedServer(config, description, advertise_host=self._advertise_host,
                                  on_release=self._released_here, waiting_for=self._waiting_for, log=log,
                                  name=f"kvsvc-worker-{self.tp_rank}")
        self._embedded = embedded
        embedded.start()
        self._blocks_per_logical = description.blocks_per_logical
        self.info = ServerInfo(embedded.address, embedded.epoch, self.tp_rank, description.blocks_per_logical)
        log.info("kvsvc: rank %d serves its KV at %s", self.tp_rank, self.info.address)
        return self.info

    @property
    def _loop(self) -> LoopThread:
        if self._embedded is None:
            raise RuntimeError("the worker's kvsvc server was not started")
        return self._embedded.loop

    @property
    def _server(self) -> RunningServer | None:
        """This rank's running server (None once stopped)."""
        try:
            return self._embedded.server if self._embedded is not None else None
        except RuntimeError:
            return None

    @property
    def gap_repairs(self) -> int:
        """Times the release stream fell behind and the gap was looked up (tests wait on it)."""
        leases = self._embedded.leases if self._embedded is not None else None
        return leases.gap_repairs if leases is not None else 0

    def _released_here(self, request_id: str, how: LeaseState) -> None:
        """P, on the loop: a lease of this rank's server ended (InProcessLeases says each once)."""
        rid = self._stream_rid.pop(request_id, None)
        if rid is not None:
            self._stream_lease.pop(rid, None)
        self._record_release(rid or request_id, how.value)

    def _waiting_for(self) -> list[str]:
        """P, on the loop: what a gap in the release stream is looked up for -- the leases of
        the requests vLLM keeps blocks for and has not heard released."""
        with self._lock:
            return [self._stream_lease.get(r, r) for r in self._delayed if r not in self._released]

    def _record_release(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._released[request_id] = None
            while len(self._released) > FINISHED_REMEMBERED:
                self._released.popitem(last=False)
            if reason in RELEASES_COUNTED:
                self._stats.count(reason)

    def shutdown(self) -> None:
        self._stopping = True
        for fut in list(self._running.values()):
            fut.cancel()
        embedded, self._embedded = self._embedded, None
        if embedded is None:
            return
        channels, self._heartbeat_channels = self._heartbeat_channels, {}
        keeper, self._kept = self._keeper, {}
        runner = self._p_runner

        async def quiet() -> None:  # the heartbeats and P's queue, before the server stops under them
            for task in (keeper, runner):
                if task is not None:
                    task.cancel()
            for c in channels.values():
                await c.close()

        try:
            embedded.loop.run(quiet(), 30)
        except Exception:
            log.warning("kvsvc: heartbeats of rank %d did not stop cleanly", self.tp_rank, exc_info=True)
        embedded.stop(5)

    # ---- each step -------------------------------------------------------------------

    def stream_layers(self, groups: list[list[str]], parts: int) -> None:
        """P: commit the chunk completing a streamed prompt layer by layer (layer_commits.py)."""
        self._layer_commits = LayerCommits(groups, parts)

    def layer_saved(self, meta: KvsvcConnectorMetadata, layer_name: str,
                    forward_done: Callable[[], Callable[[], None] | None]) -> None:
        """P, after one layer's forward was launched: its partial commits, if it completes a
        part (once forward_done()'s wait returned: the device ran the layer)."""
        if self._layer_commits is None or not meta.commit:
            return
        made = self._layer_commits.saved(layer_name, meta.commit)
        if made:
            job = functools.partial(self._commit_layers, made, forward_done())
            self._loop.loop.call_soon_threadsafe(self._enqueue, job, None)

    def start_load_kv(self, meta: KvsvcConnectorMetadata) -> None:
        if meta.revoke:  # where vLLM did not call handle_preemptions first
            self.revoke(meta)
        if meta.open:  # streamed requests' leases, opened empty ahead of this step's commits
            self._loop.loop.call_soon_threadsafe(self._enqueue, _now(functools.partial(self._open, dict(meta.open))),
                                                 None)
        if meta.delayed or meta.publish or meta.withdraw:
            # One job on the server's loop, after the earlier steps' commits, so that this
            # step's leases are made before the next step's metadata is looked at (it may
            # name them), and in this order.
            step = functools.partial(self._p_step, set(meta.delayed), set(meta.delayed_early), dict(meta.withdraw),
                                     dict(meta.publish))
            self._loop.loop.call_soon_threadsafe(self._enqueue, _now(step), None)
        for req_id, recv in meta.receive.items():
            fut = self._loop.submit(self._transfer(req_id, recv))
            self._running[req_id] = fut
            fut.add_done_callback(functools.partial(self._settle, req_id, recv))
        for req_id in meta.cancel:
            if req_id in self._running:
                # Not the future's cancel(): that would report the transfer ended (and vLLM
                # free its blocks) at once, while a READ may still write into them.
                self._loop.loop.call_soon_threadsafe(self._give_up, req_id)
        if self.tp_rank == 0:  # one abort per abandoned request is enough (it names every P server)
            for req_id, params in meta.abandon.items():
                self._loop.submit(self._abandon(req_id, params))
            if meta.keep_alive or meta.stop_keep_alive:
                self._loop.loop.call_soon_threadsafe(self._update_kept, dict(meta.keep_alive),
                                                     set(meta.stop_keep_alive))

    # ---- P: the queue of steps, streamed requests ---------------------------------------

    def commit_after_forward(self, meta: KvsvcConnectorMetadata, forward_done: Callable[[], None] | None) -> None:
        """P, after this step's forward was launched: commit the chunks it computes, once
        forward_done() returned (the device finished it; None: it has already)."""
        if meta.commit:
            lc = self._layer_commits
            commits = lc.ended(meta.commit) if lc is not None else dict(meta.commit)
            job = functools.partial(self._commit_step, commits, forward_done)
            self._loop.loop.call_soon_threadsafe(self._enqueue, job, None)

    def revoke(self, meta: KvsvcConnectorMetadata) -> None:
        """P, before this step's forward: take back the leases of streamed requests whose
        blocks vLLM freed. Returns once done (after the earlier steps' commits), so no READ
        of those blocks can be confirmed once the forward may overwrite them."""
        revokes, meta.revoke = dict(meta.revoke), {}
        if not revokes or self._embedded is None:
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop.loop.call_soon_threadsafe(self._enqueue, _now(functools.partial(self._revoke_here, revokes)), done)
        try:
            done.result(REVOKE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"kvsvc: rank {self.tp_rank} could not take back {len(revokes)} streamed leases in "
                               f"{REVOKE_TIMEOUT_S:.0f} s; stopping rather than overwrite blocks a D may read") from None

    def _enqueue(self, job: Callable[[], Awaitable[None]], done: concurrent.futures.Future[None] | None) -> None:
        """On the loop: run job after every job queued before it."""
        if self._p_jobs is None:
            self._p_jobs = asyncio.Queue()
            self._p_runner = asyncio.ensure_future(self._run_p_jobs(self._p_jobs))
        self._p_jobs.put_nowait((job, done))

    async def _run_p_jobs(self, jobs: asyncio.Queue[Any]) -> None:
        while True:
            job, done = await jobs.get()
            try:
                await job()
            except Exception:
                log.exception("kvsvc: rank %d: a prefill step's lease work failed", self.tp_rank)
            finally:
                if done is not None and not done.done():
                    done.set_result(None)

    def _open(self, opens: dict[str, Commit]) -> None:
        leases = self._embedded.leases if self._embedded is not None else None
        if leases is not None:
            for rid, c in opens.items():
                self._commit(leases, rid, c)

    async def _commit_step(self, commits: dict[str, Commit], forward_done: Callable[[], None] | None) -> None:
        if forward_done is not None:
            await asyncio.to_thread(forward_done)
        leases = self._embedded.leases if self._embedded is not None else None
        if leases is None:
            return
        for rid, c in commits.items():
            self._commit(leases, rid, c)

    async def _commit_layers(self, made: list[PartialCommit], layer_done: Callable[[], None] | None) -> None:
        if layer_done is not None:
            await asyncio.to_thread(layer_done)
        leases = self._embedded.leases if self._embedded is not None else None
        if leases is not None:
            for m in made:
                if self._commit(leases, m.request_id, m.commit, m.layers_done):
                    with self._lock:
                        self._stats.count("layer_commits")

    def _commit(self, leases: InProcessLeases, rid: str, c: Commit, layers: tuple[int, ...] = ()) -> bool:
        """One chunk of a streamed request on this rank's server: open its lease (epoch 1, as
        the request arrives) or append to it (layers: some layers of it, layer_commits.py).
        A refused commit takes the lease back (its blocks go back to vLLM once the request is
        delayed); a commit after a revoke or a failure is dropped. True: made."""
        blocks = [pb.BlockIds(block_ids=g) for g in c.block_ids]
        try:
            if c.epoch == 1:
                self._stream_rid[c.lease_id], self._stream_lease[rid] = rid, c.lease_id
                leases.lease(pb.PublishBlocksRequest(
                    request_id=c.lease_id, block_ids_per_group=blocks, lease_token=c.lease_token,
                    lease_ttl_ms=c.lease_ttl_ms, num_tokens=c.num_tokens, progressive=True))
            elif self._stream_lease.get(rid) == c.lease_id:
                leases.commit(pb.CommitBlocksRequest(
                    request_id=c.lease_id, lease_token=c.lease_token, commit_epoch=c.epoch, num_tokens=c.num_tokens,
                    block_ids_per_group=blocks, final=c.final, layers_done=layers))
            else:
                return False
        except KvsvcError as e:
            log.info("kvsvc: rank %d: commit %d of %s (%s) refused: %s", self.tp_rank, c.epoch, rid, c.lease_id, e)
            self._drop_stream(leases, rid, c.lease_id, c.lease_token)
            self._record_release(rid, "")  # nobody reads its blocks any more
            return False
        return True

    def _revoke_here(self, revokes: dict[str, tuple[str, str]]) -> None:
        leases = self._embedded.leases if self._embedded is not None else None
        if leases is None:  # shutting down: nothing is read from this server any more
            return
        for rid, (lease_id, token) in revokes.items():
            self._drop_stream(leases, rid, lease_id, token)

    def _drop_stream(self, leases: InProcessLeases, rid: str, lease_id: str, token: str) -> None:
        """Take back a streamed request's lease, final or not (a D reading it fails typed and
        uses nothing); one never made is refused, so a D waiting for it fails now."""
        if self._stream_lease.get(rid) == lease_id:
            del self._stream_lease[rid]
        self._stream_rid.pop(lease_id, None)
        if not leases.withdraw(lease_id, token, even_final=True):
            log.warning("kvsvc: rank %d: the lease %s of %s is not this request's to take back", self.tp_rank,
                        lease_id, rid)
        elif not leases.is_live(lease_id) and leases.final_state(lease_id) is None:
            leases.refuse(lease_id, token)

    def _p_step(self, delayed: set[str], delayed_early: set[str], withdraw: dict[str, str],
                publish: dict[str, Publish]) -> None:
        """P, on the server's loop, for one step: the requests vLLM now keeps blocks for
        (one whose early lease could not be made gets them back at once), the early leases
        nobody will claim, then this step's leases. Never raises."""
        with self._lock:
            for rid in delayed:
                self._delayed[rid] = None
            while len(self._delayed) > FINISHED_REMEMBERED:
                self._delayed.popitem(last=False)
        for rid in delayed_early & self._early_failed.keys():
            del self._early_failed[rid]
            self._record_release(rid, "")
        leases = self._embedded.leases if self._embedded is not None else None
        if leases is None:  # shutting down: vLLM frees everything anyway
            return
        for rid, token in withdraw.items():
            self._early_failed.pop(rid, None)
            try:
                leases.withdraw(rid, token)
            except KvsvcError as e:
                log.warning("kvsvc: rank %d could not take back the early lease of %s: %s", self.tp_rank, rid, e)
        for rid, order in publish.items():
            self._lease(leases, rid, order)
        # Every request vLLM now keeps blocks for has had its lease made (in this step or,
        # early, in an earlier one; a streamed one by its commits, queued before this). One
        # with no live lease left was released before vLLM said so -- an early lease released
        # while the release stream was behind is heard of no other way -- and is reported
        # now (twice is harmless: reported once).
        for rid in delayed:
            if not leases.is_live(self._stream_lease.get(rid, rid)):
                self._record_release(rid, "")

    def _lease(self, leases: InProcessLeases, rid: str, order: Publish) -> None:
        """Lease one request's blocks on this rank's server, in process, under the token the
        scheduler minted. A refused lease leaves a tombstone, so a D already asking for it
        fails at once instead of waiting, and its blocks go back to vLLM: now, or for an
        early lease once the scheduler says it handed that lease's params out."""
        req = pb.PublishBlocksRequest(request_id=rid, lease_ttl_ms=order.lease_ttl_ms, num_tokens=order.num_tokens,
                                      block_ids_per_group=[pb.BlockIds(block_ids=g) for g in order.block_ids],
                                      lease_token=order.lease_token)
        try:
            leases.lease(req)
        except Exception as e:
            log.warning("kvsvc: rank %d could not lease %s for decode (its blocks are freed): %s",
                        self.tp_rank, rid, e)
            leases.refuse(rid, order.lease_token)
            with self._lock:
                self._stats.count("lease_failed")
            if order.early:
                self._early_failed[rid] = None
                while len(self._early_failed) > FINISHED_REMEMBERED:
                    self._early_failed.popitem(last=False)
            else:
                self._record_release(rid, "")

    def _give_up(self, req_id: str) -> None:
        """On the loop: cancel req_id's transfer (or, not started yet, keep it from starting)."""
        if self._embedded is not None:
            self._embedded.cancel_here(req_id)

    async def _transfer(self, req_id: str, recv: Receive) -> Any:
        """On the loop: one request's load; ends only once nothing of it can write into its
        blocks (vLLM frees and may reuse them once told it ended)."""
        embedded = self._embedded
        if embedded is None:
            raise RuntimeError("the worker's kvsvc server stopped")
        log.debug("kvsvc: loading %s into %s", req_id, [len(g) for g in recv.local_block_ids])
        # No await before transfer_here: a cancel that comes first is found there.
        params = kvparams.from_vllm(recv.params)
        local = kernel_block_ids(recv.local_block_ids, self._blocks_per_logical)
        return await embedded.transfer_here(req_id, params, local, self._timeout_for(params.progressive),
                                            local_prefix_tokens=recv.prefix_tokens)

    def _settle(self, req_id: str, recv: Receive, fut: concurrent.futures.Future[Any]) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        with self._lock:
            self._running.pop(req_id, None)
            if fut.cancelled():
                self._stats.count("cancelled")
                self._totals["cancelled"] += 1
            elif failed:
                self._stats.count("failed")
                self._totals["failed"] += 1
                log.warning("kvsvc: transfer of %s failed: %s", req_id, fut.exception())
            else:
                resp = fut.result()
                self._totals["loaded"] += 1
                self._totals["bytes"] += resp.total_bytes
                self._stats.count("chunks_growing", resp.chunks_read_growing)
                self._stats.count("chunks_final", resp.chunks_read_final)
                wire_us = max((r.duration_us for r in resp.ranks), default=0)
                self._stats.record_transfer(xfer_s=resp.duration_us / 1e6, wire_s=wire_us / 1e6,
                                            nbytes=resp.total_bytes, descriptors=sum(r.num_descriptors for r in resp.ranks))
                if not is_streamed(recv.params):  # a stream's call also waits for P's prefill
                    self._stats.record_overhead(max(0, resp.duration_us - wire_us) / 1e6)
                elif resp.after_final_us:
                    self._stats.record_after_final(resp.after_final_us / 1e6)
                log.debug("kvsvc: %s loaded, %d bytes in %.2f ms", req_id, resp.total_bytes, resp.duration_us / 1e3)
            if recv.awaiting:  # a full local hit is not waited for: it only frees P's lease
                self._recv_done.add(req_id)
                self._settled_at[req_id] = time.perf_counter()
                if failed:
                    self._recv_failed.add(req_id)

    def _update_kept(self, new: dict[str, dict[str, Any]], done: set[str]) -> None:
        """On the loop: requests that started or stopped waiting in D's queue; a new one is
        heartbeated at once (its lease may be old already), then every lease_heartbeat_s."""
        if self._heartbeat_s <= 0:
            return
        for req_id, params in new.items():
            try:
                self._kept[req_id] = kvparams.from_vllm(params)
            except KvsvcError:
                continue  # the load will refuse these params itself
        for req_id in done:
            self._kept.pop(req_id, None)
        if new and self._kept:
            self._beat_now.set()
        if self._kept and (self._keeper is None or self._keeper.done()):
            self._keeper = asyncio.ensure_future(self._keep_alive())

    async def _keep_alive(self) -> None:
        """On the loop while any request waits: heartbeat the waiting requests' P leases
        (never raises: a failure is logged and the next round tries again)."""
        while self._kept:
            self._beat_now.clear()
            try:
                waiting = dict(self._kept)
                # Each call has heartbeat_published's own timeout (5 s): a P that has not
                # answered by then is asked again next round. Not shorter: a P slow under
                # load would miss every round and let the leases run out.
                answers = await heartbeat_published(waiting, engine_id=self.engine_id, options=self._options,
                                                    channels=self._heartbeat_channels)
                # Only P's word that a lease is gone (a final state, a refusal) stops its
                # heartbeats; a P not reached or stalled past a call's timeout is asked again
                # next round, while the lease may still be alive.
                lost = {r: a for r, a in answers.items() if r in self._kept and any(
                    v not in KEPT and not heartbeat_is_transient(v) for v in a.values())}
                unanswered = {r: a for r, a in answers.items() if r in self._kept and r not in lost and any(
                    heartbeat_is_transient(v) for v in a.values())}
                for r in lost:  # nothing left to keep: its load will fail (and D recompute)
                    self._kept.pop(r, None)
                if lost:
                    log.warning("kvsvc: the leases of %d waiting requests were already gone: %s", len(lost),
                                dict(list(lost.items())[:4]))
                if any(v not in KEPT for a in answers.values() for v in a.values()):
                    self.heartbeat_rounds_short += 1
                if unanswered:
                    log.warning("kvsvc: %d waiting requests' lease heartbeats went unanswered (tried again in "
                                "%.1f s): %s", len(unanswered), self._heartbeat_s, dict(list(unanswered.items())[:4]))
                await self._trim_heartbeat_channels({s.address for p in self._kept.values() for s in servers_of(p)})
            except Exception as e:
                log.warning("kvsvc: lease heartbeat failed: %s", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self._heartbeat_s)
        await self._trim_heartbeat_channels(set())

    async def _trim_heartbeat_channels(self, in_use: set[str]) -> None:
        """Close the kept channels to P servers no waiting request names any more (bounded:
        a P engine restarted on new ports leaves none behind)."""
        for address in [a for a in self._heartbeat_channels if a not in in_use]:
            await self._heartbeat_channels.pop(address).close()

    async def _abandon(self, req_id: str, params: dict[str, Any]) -> None:
        try:
            if self._embedded is None:
                return
            # Through the embedded server: the P servers it read from already have a channel.
            answers = await self._embedded.abandon_here(kvparams.from_vllm(params))
            log.info("kvsvc: %s abandoned before its transfer: %s", req_id, answers)
        except Exception as e:
            log.warning("kvsvc: could not abort the lease of %s: %s", req_id, e)

    def totals(self) -> dict[str, int]:
        """D: transfers loaded, failed and cancelled since start, and the bytes loaded."""
        with self._lock:
            return dict(self._totals)

    def take_stats(self) -> KvsvcConnectorStats | None:
        """What happened since the last call (None: nothing)."""
        with self._lock:
            stats, self._stats = self._stats, KvsvcConnectorStats()
        return None if stats.is_empty() else stats

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        with self._lock:
            # Only requests the scheduler delayed: a release of any other (vLLM freed its
            # blocks already) must not reach vLLM's scheduler, which fails hard on it.
            small, big = sorted((self._released, self._delayed), key=len)
            sending = {rid for rid in small if rid in big}
            for rid in sending:
                del self._released[rid]
                del self._delayed[rid]
            recving, failed = self._recv_done, self._recv_failed
            self._recv_done, self._recv_failed = set(), set()
            now = time.perf_counter()
            for rid in recving:  # how long vLLM took to ask (it asks once per step)
                self._stats.record_report_delay(now - self._settled_at.pop(rid, now))
        return sending, recving, failed


def _now(step: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    """A plain step as a job of the queue."""
    async def run() -> None:
        step()

    return run
