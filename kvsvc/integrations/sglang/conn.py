"""SGLang's disaggregation transfer backend "kvsvc": the manager, sender, receiver and
bootstrap server SGLang asks get_kv_class for.

What stays SGLang's (inherited from its Common* classes): the bootstrap server and rank
discovery, the ZMQ channels, D's heartbeats to P, abort notifications, timeouts, KVPoll.
What kvsvc does: the KV pages move through a kvsvc server embedded in each TP worker,
over SGLang's pools registered in place.

Pull, not push. SGLang's own backends push (P writes into D's pages); here D reads:
  1. D allocates its pages and sends METADATA to the P ranks it reads (SGLang's mapping,
     which matches kvsvc's handshake targets for every TP pair).
  2. P prefills; on the request's last chunk each of those P ranks leases all its pages on
     its kvsvc server (one token for the request across the engine's ranks) and answers
     READY with the lease's params and the request's aux row. Streamed (the `progressive`
     setting): the lease opens at the first chunk, READY goes then, each later chunk is
     committed to the lease, and the aux row follows in an AUX message before the final
     commit; D reads while P prefills.
  3. D joins the pieces into one TransferParams and runs a kvsvc Transfer in process: the
     planner picks what each D rank reads from which P rank (heterogeneous TP, MLA), the
     claim makes D the lease's one owner, READs move the bytes, CONSUMED releases the lease.
  4. D writes the aux row and reports Success once the transfer settled; P reports Success
     when its lease is released CONSUMED (Failed with kvsvc's reason on EXPIRED/ABORTED),
     and only then does SGLang free P's pages.
Why pull: kvsvc's promises are built on it. P frees pages only once they were consumed,
expired or aborted; D never frees or reuses pages a transfer may still write (an abort, a
dead P or a timeout on D waits until the transfer settled); every failure is typed. A push
mode would need the mirror image of all of it on P. The cost is one message more (READY)
before the bytes move, against SGLang's push of finished chunks while later ones compute.

Hybrid sliding-window models: their window layers live in a pool of their own (SGLang's SWA
state component), a second kvsvc group; P leases the window's pages SGLang names beside the
full pages, and D reads them into its own window pages.

Beside this file: rooms.py (what each side keeps of a request, as state machines),
workers.py (the listener and P's lease worker, both stopped by teardown()), engine.py (what
the backend reads of SGLang beyond KVArgs), wire.py (the messages), embedded.py (the server).

Not covered (refused at start with a clear error): other hybrid state (Mamba, DSA...), draft
KV (speculative decoding), pipeline, context and decode-context parallelism, KV sharding,
staging buffers, host destinations, and GPU-resident aux buffers.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import hmac
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_serving
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from kvsvc.config import Role
from kvsvc.errors import KvsvcError
from kvsvc.integrations.settings import EngineSettings
from kvsvc.integrations.sglang import wire
from kvsvc.integrations.sglang.embedded import SGLangServer
from kvsvc.integrations.sglang.engine import engine_secret, total_kv_heads, unsupported, window_pages, window_pool
from kvsvc.integrations.sglang.layout import SGLangPools, describe
from kvsvc.integrations.sglang.rooms import DRoom, DState, OnAbort, PRooms
from kvsvc.integrations.sglang.workers import Listener, Worker
from kvsvc.leases.table import LeaseState

log = logging.getLogger("sglang.kvsvc")

# kvsvc's settings for the backend: KVSVC_SGLANG_<NAME> for each EngineSettings field (e.g.
# KVSVC_SGLANG_TRANSFER_TIMEOUT_S, KVSVC_SGLANG_LEASE_TTL_MS, KVSVC_SGLANG_CONFIG: a kvsvc
# TOML whose [server] keys apply to the embedded servers), read when the backend starts.
SETTINGS_PREFIX = "KVSVC_SGLANG_"

# Requests a P rank keeps track of (rooms.PRooms): the oldest go first beyond it.
MAX_P_ROOMS = 1 << 16

# How long teardown waits for each of the backend's threads to end.
STOP_THREAD_S = 10.0

RELEASE_REASONS = {
    LeaseState.EXPIRED: "kvsvc: the decode side did not read the KV within the lease (EXPIRED)",
    LeaseState.ABORTED: "kvsvc: the decode side gave the transfer up (ABORTED)",
}


def request_id(room: int) -> str:
    return f"sglang-{room}"


def room_of(rid: str) -> int | None:
    prefix, _, room = rid.partition("-")
    return int(room) if prefix == "sglang" and room.isdigit() else None


class KvsvcKVManager(CommonKVManager):
    kv_status_msg_tag = wire.STATUS
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: ServerArgs,
                 is_mla_backend: bool | None = False) -> None:
        refused = unsupported(args, disaggregation_mode)
        if refused:
            raise ValueError("--disaggregation-transfer-backend kvsvc does not move " + "; ".join(refused)
                             + " (use SGLang's nixl or mooncake backend for this model or set-up)")
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.enable_staging = False
        self._lock = threading.Lock()
        self.settings = EngineSettings.from_environment(os.environ, SETTINGS_PREFIX)  # strict: refuses a misspelt one
        serving = get_serving()
        name = getattr(serving, "served_model_name", None) or server_args.model_path
        pools = SGLangPools(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, args.page_size,
                            bool(is_mla_backend), total_kv_heads(args, server_args, bool(is_mla_backend)),
                            self.attn_tp_size, self.settings.model_id or f"{name}|kv={args.kv_cache_dtype_str}",
                            args.gpu_id if str(server_args.device).startswith("cuda") else None,
                            window_pool(args, server_args))
        self._windowed = pools.swa is not None
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        role = Role.PREFILL if prefill else Role.DECODE
        where = self.dist_init_addr or self.local_ip
        # With data-parallel attention each DP group is an engine of its own (its scheduler,
        # its pool, its attention-TP ranks 0..n): its servers must not share an identity.
        dp = f"-dp{self.attn_dp_rank}" if self.attn_dp_size > 1 else ""
        self.kvsvc = SGLangServer(
            engine_id=f"sglang-{role.value}-{where}:{serving.port}{dp}", role=role, tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size, description=describe(pools), host=self.local_ip, settings=self.settings,
            on_release=self._released if prefill else None)
        self.kvsvc.start()
        self._lease_worker: Worker | None = None
        self._heartbeats: threading.Thread | None = None
        if prefill:
            self._secret = engine_secret(self.attn_tp_size)
            self._p_rooms = PRooms(MAX_P_ROOMS, self._p_room_evicted)
            self._lease_worker = Worker(self._lease_job, "kvsvc-sglang-lease")
            self._lease_worker.start()
        else:
            self._d_rooms: dict[int, DRoom] = {}
        self._listener = Listener(self._zmq_ctx, self.server_socket,
                                  self._on_p_message if prefill else self._on_d_message, "kvsvc-sglang-listen")
        self._listener.start()
        if not prefill:
            self._heartbeats = self._start_heartbeat_checker_thread()

    # ---- both --------------------------------------------------------------------

    def teardown(self) -> None:
        """Stop the backend's threads, then its kvsvc server (whose stop settles every
        transfer), then SGLang's sockets. The KV pools stay SGLang's."""
        stopped = self._listener.stop(STOP_THREAD_S)
        if self._lease_worker is not None:
            stopped &= self._lease_worker.stop(STOP_THREAD_S)
        if self._heartbeats is not None:
            self._heartbeat_shutdown.set()
            self._heartbeats.join(STOP_THREAD_S)
            stopped &= not self._heartbeats.is_alive()
        if not stopped:
            log.warning("kvsvc: a thread of the backend did not stop within %.0f s", STOP_THREAD_S)
        self.kvsvc.stop()
        with self._socket_lock:
            for sock in self._socket_cache.values():
                sock.close(linger=0)
            self._socket_cache.clear()
        if stopped:  # a listener that still runs may still read it
            self.server_socket.close(linger=0)

    def build_receiver_registration_message(self) -> list[bytes]:
        return wire.register(self.local_ip, self.rank_port, self.kv_args.engine_rank)

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: Any, aux_index: int | None, state_indices: Any,
                                        decode_prefix_len: int | None, is_dummy: bool,
                                        device_kv_indices: Any = None) -> list[bytes]:
        return wire.Metadata(bootstrap_room, self.local_ip, self.rank_port, self.kv_args.engine_rank,
                             np.asarray(kv_indices, dtype=np.int32), -1 if aux_index is None else int(aux_index),
                             required_dst_info_num, int(decode_prefix_len or 0), bool(is_dummy)).frames()

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status.get(bootstrap_room, KVPoll.WaitingForInput)

    def _aux_rows(self, index: int) -> list[bytes]:
        a = self.kv_args
        return [ctypes.string_at(ptr + index * item, item)
                for ptr, item in zip(a.aux_data_ptrs, a.aux_item_lens, strict=True)]

    def _write_aux(self, index: int, rows: list[bytes]) -> None:
        a = self.kv_args
        if len(rows) != len(a.aux_data_ptrs):
            raise ValueError(f"prefill sent {len(rows)} aux rows, decode has {len(a.aux_data_ptrs)} aux buffers "
                             "(an optional metadata buffer is enabled on one engine only)")
        for ptr, item, length, row in zip(a.aux_data_ptrs, a.aux_item_lens, a.aux_data_lens, rows, strict=True):
            if len(row) != item or not 0 <= index < length // item:
                raise ValueError(f"aux row of {len(row)} bytes at index {index} does not fit a {item}-byte row "
                                 f"of a {length}-byte buffer")
            ctypes.memmove(ptr + index * item, row, item)

    # ---- P -------------------------------------------------------------------------

    def _p_room_evicted(self, room_id: int) -> None:
        if room_id not in self.request_status:  # never served here: SGLang's own entry goes too
            self.transfer_infos.pop(room_id, None)

    def _on_p_message(self, msg: list[bytes]) -> None:
        try:
            self._on_p_message_parsed(msg)
        except wire.Malformed as e:
            log.warning("kvsvc: dropped a malformed message (%s)", e)

    def _on_p_message_parsed(self, msg: list[bytes]) -> None:
        if not msg:
            return
        if self._handle_bootstrap_message(msg):
            return
        if msg[0] == ABORT_TAG:
            notice = AbortNotification.from_zmq(msg)
            if notice is not None:
                self.abort_room(notice.room, "Aborted by decode-side abort notification.")
            return
        if msg[0] == wire.REGISTER:
            return  # D reads; P keeps nothing of D but the endpoints in each METADATA
        meta = wire.Metadata.parse(msg)
        with self._lock:
            ended = self._p_rooms.ended(meta.room)
        if ended is not None:  # D asks after P ended the request (aborted while bootstrapping)
            self.send_kv_status_message(targets=[(meta.ip, meta.port)], bootstrap_room=meta.room,
                                        status=KVPoll.Failed, failure_reason=ended)
            return
        with self._lock:
            room = self._p_rooms.get_or_make(meta.room)
            room.infos[(meta.ip, meta.port)] = meta
            complete = len(room.infos) >= meta.d_ranks_expected
            aborted = room.aborted
        self.transfer_infos.setdefault(meta.room, {})[(meta.ip, meta.port)] = meta
        if aborted:  # aborted before D asked: D stops waiting now
            with self.failure_lock:
                reason = self.failure_records.get(meta.room, "Aborted by AbortReq.")
            self.send_kv_status_message(targets=[(meta.ip, meta.port)], bootstrap_room=meta.room,
                                        status=KVPoll.Failed, failure_reason=reason)
            return
        if complete:
            self.req_to_decode_prefix_len[meta.room] = meta.decode_prefix_len
            self.update_status(meta.room, KVPoll.WaitingForInput)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None,
                             num_kv_tokens: int | None = None, **_: Any) -> None:
        """P's scheduler thread, for each chunk: keep the pages; on the last one hand the lease
        to the lease worker (the scheduler never waits on kvsvc). Progressive: every chunk
        goes to the lease worker, which opens the lease with the first and commits the rest."""
        window = window_pages(state_indices, self.kv_args.state_types) if is_last_chunk else None
        progressive = self.settings.progressive
        aux = None
        if is_last_chunk:
            assert aux_index is not None, "SGLang passes the aux row with the last chunk"
            # The aux row is read now: the scheduler filled it before this call and may
            # reuse the slot once the request ends.
            aux = self._aux_rows(int(aux_index))
        with self._lock:
            room = self._p_rooms.get(bootstrap_room)
            if room is None:
                return
            room.add_chunk(np.asarray(kv_indices, dtype=np.int64), window, progressive, is_last_chunk, aux)
        assert self._lease_worker is not None
        if is_last_chunk or progressive:
            self._lease_worker.put((bootstrap_room, aux))

    def _groups(self, pages: np.ndarray, window: np.ndarray | None) -> list[list[int]]:
        """A request's block ids per kvsvc group: its pages, and for a hybrid-SWA model the
        window's pages in the sliding-window pool (none where SGLang named none)."""
        groups = [[int(p) for p in pages]]
        if self._windowed:
            groups.append([] if window is None else [int(p) for p in window])
        return groups

    def token(self, room: int) -> str:
        return hmac.new(self._secret, str(room).encode(), hashlib.sha256).hexdigest()[:32]

    def _lease_job(self, job: tuple[int, list[bytes] | None]) -> None:
        room_id, aux = job
        try:
            if self.settings.progressive:
                self._stream(room_id)
            else:
                assert aux is not None
                self._lease_and_tell(room_id, aux)
        except Exception as e:
            log.exception("kvsvc: leasing request %s failed", room_id)
            with self._lock:
                room = self._p_rooms.get(room_id)
                if room is not None:
                    room.lease_refused()
            self.conclude_failure(bootstrap_room=room_id, failure_reason=f"kvsvc: leasing failed: {e}")

    def _lease_and_tell(self, room_id: int, aux: list[bytes]) -> None:
        with self._lock:
            room = self._p_rooms.get(room_id)
            pages = None if room is None else room.start_lease()
            if room is None or pages is None:
                return  # cleared or aborted before its last chunk: nothing is leased
            groups = self._groups(pages, room.window)
            infos = list(room.infos.values())
        self._lease_room(room_id, room, groups, aux, infos)

    def _stream(self, room_id: int) -> None:
        """Progressive: put every chunk not in the room's lease yet into it -- open the lease
        with the first (whole, as without streaming, when the first is also the last), commit
        the later ones, the last with `final` after D was sent the aux row."""
        while True:
            with self._lock:
                room = self._p_rooms.get(room_id)
                taken = None if room is None else room.take_unsent()
                if room is None or taken is None:
                    return
                pages, final, opening = taken
                groups = self._groups(pages, room.window if final else None)
                num_tokens = room.pages_sent * self.kv_args.page_size
                infos, epoch, aux = list(room.infos.values()), room.epoch, room.aux
            assert aux is not None or not final, "the last chunk brings the aux row"
            if opening:  # the first chunk opens the lease (leased whole when it is the last too)
                self._lease_room(room_id, room, groups, aux or [], infos, num_tokens, progressive=not final)
                continue
            if final:
                assert aux is not None
                self._tell(room_id, infos, wire.Aux(room_id, self.attn_tp_rank, aux).frames(), "its aux row")
            try:
                self.kvsvc.commit(request_id(room_id), self.token(room_id), epoch, groups, num_tokens, final)
            except KvsvcError as e:
                # D gave the request up or the lease ran out: its release fails the room.
                log.info("kvsvc: commit %d of request %s refused: %s", epoch, room_id, e.reason)
                with self._lock:
                    room.stop_stream()
                return

    def _lease_room(self, room_id: int, room: Any, groups: list[list[int]], aux: list[bytes], infos: list[Any],
                    num_tokens: int = 0, progressive: bool = False) -> None:
        """Lease the room's pages (progressive: open its growing lease) and tell D's ranks READY
        (aux: the request's aux row; empty for a progressive lease, whose row comes later)."""
        try:
            params = self.kvsvc.lease(request_id(room_id), groups, self.token(room_id), self.settings.lease_ttl_ms,
                                      num_tokens=num_tokens, progressive=progressive)
        except KvsvcError as e:
            with self._lock:
                room.lease_refused()
            self.conclude_failure(bootstrap_room=room_id, failure_reason=f"kvsvc: {e.reason}: {e.message}")
            return
        with self._lock:
            tell = room.lease_made()
        if not tell:  # aborted while the lease was being made: abort_room left it to this worker
            self._withdraw(room_id)
            return
        self.update_status(room_id, KVPoll.Transferring)
        self._tell(room_id, infos, wire.Ready(room_id, self.attn_tp_rank, params, aux).frames(), "it is ready")

    def _tell(self, room_id: int, infos: list[Any], frames: list[bytes], what: str) -> None:
        for info in infos:
            na = NetworkAddress(info.ip, info.port)
            try:
                self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            except zmq.ZMQError as e:
                log.warning("kvsvc: could not tell %s %s for request %s: %s", na.to_host_port_str(), what, room_id, e)

    def abort_room(self, room_id: int, reason: str) -> None:
        """P: the request is aborted (by P's scheduler or D's notice), perhaps before D's
        METADATA came. Its pages go back to SGLang once nobody can read them: at once unless
        D already claimed the lease; D hears of it now rather than at its own timeout."""
        with self._lock:
            then = self._p_rooms.get_or_make(room_id).abort()
        if then is OnAbort.NOTHING or self.request_status.get(room_id) == KVPoll.Success:
            return
        if then is OnAbort.FAIL:
            self.conclude_failure(bootstrap_room=room_id, failure_reason=reason)  # to D's ranks known so far
            return
        self.record_failure(room_id, reason)
        if then is OnAbort.WITHDRAW:
            self._withdraw(room_id)
        # OnAbort.LEASE_WORKER: the lease worker takes the lease back once it is made

    def _withdraw(self, room_id: int) -> None:
        """Take the lease back; the room fails (SGLang frees its pages) only once the server
        said nobody can read them. Not waited for here: a server loop that stalls must
        neither block SGLang's scheduler nor be taken as an answer (a withdraw that ran late
        could find D's claim, and pages freed meanwhile would be read while refilled)."""
        try:
            answer = self.kvsvc.withdraw_later(request_id(room_id), self.token(room_id))
        except Exception as e:  # the server has stopped: it reads nothing any more
            log.warning("kvsvc: could not take back the lease of %s: %s", room_id, e)
            self.update_status(room_id, KVPoll.Failed)
            return
        answer.add_done_callback(lambda f: self._withdrawn(room_id, f))

    def _withdrawn(self, room_id: int, answer: concurrent.futures.Future[bool]) -> None:
        try:
            gone = answer.result()
        except Exception as e:  # the server stopped before it ran: it reads nothing any more
            log.warning("kvsvc: could not take back the lease of %s: %s", room_id, e)
            gone = True
        if gone:
            self.update_status(room_id, KVPoll.Failed)
        # else: D holds a claim; its release (consumed or aborted) ends the room

    def _released(self, rid: str, how: LeaseState) -> None:
        """On the server's loop: a lease of this rank ended."""
        room_id = room_of(rid)
        if room_id is None or room_id not in self.request_status:
            return
        with self._lock:
            room = self._p_rooms.get(room_id)
            aborted = room is not None and room.aborted
        if how is LeaseState.CONSUMED and not aborted:
            self.update_status(room_id, KVPoll.Success)
            return
        if not aborted:
            self.record_failure(room_id, RELEASE_REASONS.get(how, f"kvsvc: lease {how.value}"))
        self.update_status(room_id, KVPoll.Failed)

    def forget_p_room(self, room_id: int, failure: str | None) -> None:
        """The sender is cleared; failure: why the request failed (None: it succeeded). A
        METADATA that comes later (D was slower than P's abort) is answered with it."""
        ended = self.request_status.get(room_id) in (KVPoll.Success, KVPoll.Failed)
        with self._lock:
            room = self._p_rooms.clear(room_id, failure)
            # Cleared while leased (never seen in SGLang's flow): free nothing readable. A lease
            # still being made is taken back by the lease worker once made.
            then = room.abort() if room is not None and room.leased and not ended else OnAbort.NOTHING
        if then is OnAbort.WITHDRAW:
            self._withdraw(room_id)

    # ---- D -------------------------------------------------------------------------

    def expect(self, room_id: int, pages: Any, aux_index: int | None, p_ranks: int, state_indices: Any) -> None:
        with self._lock:
            self._d_rooms[room_id] = DRoom(np.asarray(pages, dtype=np.int64),
                                           -1 if aux_index is None else int(aux_index), p_ranks,
                                           window_pages(state_indices, self.kv_args.state_types))

    def _on_d_message(self, msg: list[bytes]) -> None:
        if not msg:
            return
        if self.handle_abort_ack_message(msg):
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room_id, status, prefill_rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room_id, status=status, prefill_rank=prefill_rank,
                                      failure_reason=reason)
            return
        try:
            if msg[0] == wire.AUX:
                self._aux_came(wire.Aux.parse(msg))
                return
            ready = wire.Ready.parse(msg)
        except wire.Malformed as e:
            log.warning("kvsvc: dropped a malformed message (%s)", e)
            return
        self._start_transfer(ready)

    def _aux_came(self, aux: wire.Aux) -> None:
        """A progressive P rank's aux row: kept for the room; a room whose transfer already
        succeeded (LOADED) ends now."""
        with self._lock:
            room = self._d_rooms.get(aux.room)
            if room is None:
                return
            room.add_aux(aux.p_rank, aux.rows)
            finish = room.state is DState.LOADED and room.aux() is not None
            if finish:
                del self._d_rooms[aux.room]
        if finish:
            self._finish(aux.room, room)

    def _start_transfer(self, ready: wire.Ready) -> None:
        """Start the room's transfer once every P rank's READY is in. Decided and started under
        the lock, so SGLang failing the room at the same time either stops it starting or
        finds it running (and waits for it to settle)."""
        room_id, failure = ready.room, None
        with self._lock:
            room = self._d_rooms.get(room_id)
            pieces = None if room is None else room.add_piece(ready.p_rank, ready)
            if room is None or pieces is None:
                return  # cleared, failed, a duplicate, or more to come
            try:
                params = wire.join_params(pieces)
            except wire.Malformed as e:
                room.fail()
                failure = f"kvsvc: {e}"
            else:
                if self.request_status.get(room_id) == KVPoll.Failed:
                    room.fail()
                    return
                fut = self.kvsvc.transfer(request_id(room_id), params, self._groups(room.pages, room.window),
                                          self.settings.timeout_for(params.progressive))
                room.run(fut)
        if failure is not None:
            self.record_failure(room_id, failure)
            super().update_status(room_id, KVPoll.Failed)
            return
        started = time.perf_counter()
        super().update_status(room_id, KVPoll.Transferring)
        fut.add_done_callback(lambda f: self._transfer_ended(room_id, room, f, started))

    def _transfer_ended(self, room_id: int, room: DRoom, fut: Any, started: float) -> None:
        """On the server's loop, once the transfer settled: nothing of it writes any more."""
        ok = not fut.cancelled() and fut.exception() is None
        with self._lock:
            failed = room.state is DState.FAILING
            waiting = ok and not failed and room.loaded()  # progressive: P's aux row is still on its way
            if self._d_rooms.get(room_id) is room and not waiting:
                del self._d_rooms[room_id]
        if fut.cancelled() or failed:
            super().update_status(room_id, KVPoll.Failed)
            return
        error = fut.exception()
        if error is not None:
            self._load_failed(room_id, error)
            return
        resp = fut.result()
        log.debug("kvsvc: request %s loaded, %d bytes in %.2f ms", room_id, resp.total_bytes,
                  (time.perf_counter() - started) * 1e3)
        if not waiting:
            self._finish(room_id, room)

    def _finish(self, room_id: int, room: DRoom) -> None:
        """The pages hold P's KV: write the aux row, and the request is loaded."""
        aux = room.aux()
        assert aux is not None
        try:
            self._write_aux(room.aux_index, aux)
        except ValueError as e:
            self._load_failed(room_id, e)
            return
        super().update_status(room_id, KVPoll.Success)

    def _load_failed(self, room_id: int, error: BaseException) -> None:
        reason = f"kvsvc: {error.reason}: {error.message}" if isinstance(error, KvsvcError) else f"kvsvc: {error}"
        log.warning("kvsvc: loading request %s failed: %s", room_id, reason)
        self.record_failure(room_id, reason)
        super().update_status(room_id, KVPoll.Failed)

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        """D: a room SGLang fails (abort, dead P, timeout) while its transfer may still write
        into its pages stays as it is until the transfer settled, then fails."""
        if status == KVPoll.Failed and self.disaggregation_mode == DisaggregationMode.DECODE:
            with self._lock:
                room = self._d_rooms.get(bootstrap_room)
                running = room is not None and room.fail()
            if running:
                self.kvsvc.cancel(request_id(bootstrap_room))
                return
        super().update_status(bootstrap_room, status)

    def transfer_running(self, room_id: int) -> bool:
        with self._lock:
            room = self._d_rooms.get(room_id)
            return room is not None and room.running

    def forget_d_room(self, room_id: int) -> None:
        with self._lock:
            room = self._d_rooms.get(room_id)
            # A running transfer's end removes its room; one loaded (waiting for its aux row) goes now.
            if room is not None and (room.transfer is None or room.state in (DState.LOADED, DState.FAILED)):
                del self._d_rooms[room_id]


class KvsvcKVSender(CommonKVSender):
    kv_mgr: KvsvcKVManager

    def abort(self) -> None:
        """Failed once nobody can read the pages (SGLang frees them on Failed)."""
        self.kv_mgr.abort_room(self.bootstrap_room, "Aborted by AbortReq.")
        self.trace_ctx.abort(abort_info={"reason": "Aborted"})

    def clear(self) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        succeeded = mgr.request_status.get(room) == KVPoll.Success
        with mgr.failure_lock:
            failure = None if succeeded else mgr.failure_records.get(room, "the prefill side ended the request")
        super().clear()
        mgr.forget_p_room(room, failure)


class KvsvcKVReceiver(CommonKVReceiver):
    kv_mgr: KvsvcKVManager

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, *args: Any, **kwargs: Any) -> None:
        if self.bootstrap_infos:
            self.kv_mgr.expect(self.bootstrap_room, kv_indices, aux_index, len(self.bootstrap_infos), state_indices)
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)

    def poll(self) -> KVPoll:
        # A running transfer is never timed out from here: its own timeout ends it, and SGLang
        # must not free pages it may still write.
        if self.conclude_state is None and self.kv_mgr.transfer_running(self.bootstrap_room):
            return KVPoll.Transferring
        return super().poll()

    def abort(self) -> None:
        if self.kv_mgr.transfer_running(self.bootstrap_room):
            # Failed once the transfer settled (the manager's update_status); P hears of it
            # from the cancelled transfer's own abort of the lease, and from the notice.
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.ensure_abort_notified()
            return
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_d_room(self.bootstrap_room)


class KvsvcKVBootstrapServer(CommonKVBootstrapServer):
    pass
