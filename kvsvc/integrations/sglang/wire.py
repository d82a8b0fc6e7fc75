"""The messages SGLang's kvsvc backend sends over SGLang's own ZMQ channels.

D -> P (to each P rank it reads, as SGLang's backends do):
  REGISTER  once per P rank: who D is (P keeps nothing of it: D reads, P never writes to D).
  METADATA  per request: D's pages for it, its aux row, how many D ranks P will hear from.
P -> D (to each D rank that sent METADATA):
  READY     P leased the request's pages on its kvsvc server: the params of that lease (this
            P rank's server) and the request's aux row (first token, logprobs, ...). A
            progressive lease's READY comes at P's first chunk, without the aux row:
  AUX       the aux row of a request whose lease P opened progressive, once its last chunk
            was computed (before its final commit).
Failures go back on SGLang's own status message (KvsvcKVManager.kv_status_msg_tag, with a
reason), aborts on SGLang's AbortNotification.

Every frame is bounded and checked: a malformed message is dropped with a log line by the
listener, never raised into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsvc.v1 import kv_transfer_pb2 as pb

REGISTER = b"KVSVC_REGISTER"
METADATA = b"KVSVC_METADATA"
READY = b"KVSVC_READY"
AUX = b"KVSVC_AUX"
STATUS = b"KVSVC_STATUS"

MAX_PAGES = 1 << 24  # pages of one request (64 MiB of int32 indices)
MAX_PARAMS_BYTES = 1 << 26
MAX_AUX_BYTES = 1 << 24


class Malformed(ValueError):
    """A message that is not one of ours, or breaks a limit."""


def _int(frame: bytes, what: str) -> int:
    try:
        return int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise Malformed(f"{what}: not an integer") from None


def _text(frame: bytes, what: str) -> str:
    try:
        return frame.decode("ascii")
    except UnicodeDecodeError:
        raise Malformed(f"{what}: not ASCII") from None


def register(ip: str, port: int, rank: int) -> list[bytes]:
    return [REGISTER, ip.encode(), str(port).encode(), str(rank).encode()]


@dataclass(frozen=True)
class Metadata:
    room: int
    ip: str  # D rank's ZMQ endpoint (where READY and status go)
    port: int
    rank: int  # D's attention TP rank
    pages: np.ndarray  # int32: D's pages, in token order
    aux_index: int
    d_ranks_expected: int  # METADATA messages this P rank gets for the room (SGLang's required_dst_info_num)
    decode_prefix_len: int  # tokens D has cached already (its pages start after them)
    is_dummy: bool  # a P rank D reads nothing from but that holds a lease for D to release

    # As SGLang's own TransferInfo names them (its conclude_failure finds D's endpoints so).
    @property
    def endpoint(self) -> str:
        return self.ip

    @property
    def dst_port(self) -> int:
        return self.port

    def frames(self) -> list[bytes]:
        return [METADATA, str(self.room).encode(), self.ip.encode(), str(self.port).encode(),
                str(self.rank).encode(), b"" if self.is_dummy else self.pages.astype(np.int32).tobytes(),
                str(self.aux_index).encode(), str(self.d_ranks_expected).encode(),
                str(self.decode_prefix_len).encode(), b"1" if self.is_dummy else b"0"]

    @classmethod
    def parse(cls, msg: list[bytes]) -> Metadata:
        if len(msg) != 10 or msg[0] != METADATA:
            raise Malformed(f"METADATA has {len(msg)} frames, not 10")
        if len(msg[5]) % 4 or len(msg[5]) // 4 > MAX_PAGES:
            raise Malformed(f"METADATA pages: {len(msg[5])} bytes")
        return cls(room=_int(msg[1], "room"), ip=_text(msg[2], "ip"), port=_int(msg[3], "port"),
                   rank=_int(msg[4], "rank"), pages=np.frombuffer(msg[5], dtype=np.int32).copy(),
                   aux_index=_int(msg[6], "aux_index"), d_ranks_expected=_int(msg[7], "d_ranks_expected"),
                   decode_prefix_len=_int(msg[8], "decode_prefix_len"), is_dummy=msg[9] == b"1")


@dataclass(frozen=True)
class Ready:
    room: int
    p_rank: int
    params: pb.TransferParams  # the lease on this P rank's server
    aux: list[bytes]  # the request's row of each aux buffer, in buffer order

    def frames(self) -> list[bytes]:
        return [READY, str(self.room).encode(), str(self.p_rank).encode(), self.params.SerializeToString(),
                *self.aux]

    @classmethod
    def parse(cls, msg: list[bytes]) -> Ready:
        if len(msg) < 4 or msg[0] != READY:
            raise Malformed(f"READY has {len(msg)} frames")
        if len(msg[3]) > MAX_PARAMS_BYTES or sum(len(f) for f in msg[4:]) > MAX_AUX_BYTES:
            raise Malformed("READY is too large")
        params = pb.TransferParams()
        try:
            params.ParseFromString(msg[3])
        except Exception as e:  # protobuf's DecodeError
            raise Malformed(f"READY params: {e}") from None
        return cls(room=_int(msg[1], "room"), p_rank=_int(msg[2], "p_rank"), params=params, aux=list(msg[4:]))


@dataclass(frozen=True)
class Aux:
    room: int
    p_rank: int
    rows: list[bytes]  # the request's row of each aux buffer, in buffer order

    def frames(self) -> list[bytes]:
        return [AUX, str(self.room).encode(), str(self.p_rank).encode(), *self.rows]

    @classmethod
    def parse(cls, msg: list[bytes]) -> Aux:
        if len(msg) < 3 or msg[0] != AUX:
            raise Malformed(f"AUX has {len(msg)} frames")
        if sum(len(f) for f in msg[3:]) > MAX_AUX_BYTES:
            raise Malformed("AUX is too large")
        return cls(room=_int(msg[1], "room"), p_rank=_int(msg[2], "p_rank"), rows=list(msg[3:]))


def join_params(pieces: list[Ready]) -> pb.TransferParams:
    """One TransferParams from the leases of every P rank a D rank reads: the same request,
    pages and token on each (one engine), each piece naming its own server."""
    pieces = sorted(pieces, key=lambda r: r.p_rank)
    first = pieces[0].params
    joined = pb.TransferParams()
    joined.CopyFrom(first)
    del joined.remote_servers[:]
    for piece in pieces:
        p = piece.params
        if (p.lease_token, p.remote_request_id, p.remote_tp_size, p.remote_engine_id, p.progressive) != (
                first.lease_token, first.remote_request_id, first.remote_tp_size, first.remote_engine_id,
                first.progressive) \
                or (not first.progressive  # growing leases may open with more or fewer chunks (D checks commits)
                    and list(p.remote_block_ids_per_group) != list(first.remote_block_ids_per_group)):
            raise Malformed(f"prefill ranks {pieces[0].p_rank} and {piece.p_rank} leased different requests")
        joined.remote_servers.extend(p.remote_servers)
    return joined
