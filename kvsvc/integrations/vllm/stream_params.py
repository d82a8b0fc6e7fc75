"""The kv_transfer_params of a streamed request (progressive pull), as plain dicts.

A router that dispatches a request to P and D together names the lease before P has made
it: it mints the lease's id and token, tells P to lease the request under them
(`STREAM_KEY` in P's kv_transfer_params) and hands D params naming that lease-to-be, built
from what P said of itself in an earlier answer (its engine id, servers and their epochs:
`identity`). P opens the lease at its first computed chunk and commits each later one; D
claims it (it waits for the lease to be made, lease_pending) and reads each chunk while P
computes the next. No protobuf here: the router imports this module alone.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEY = "kvsvc"  # as params.KEY: kvsvc's TransferParams inside vLLM's kv_transfer_params
STREAM_KEY = "kvsvc_stream"
MAX_LEASE_ID_CHARS = 128
_TOKEN = re.compile(r"[0-9a-f]{32}")
# What P's params say of one request only: the rest describes P itself and names the lease-to-be.
_PER_REQUEST = ("remote_request_id", "remote_block_ids_per_group", "lease_token", "remote_num_tokens",
                "lease_pending", "progressive")


@dataclass(frozen=True, slots=True)
class StreamOrder:
    """P: lease this request under lease_id and token, opened at its first chunk."""

    lease_id: str
    token: str


def new_stream() -> StreamOrder:
    """A lease id and token for one streamed request (the token as kvsvc mints its own)."""
    return StreamOrder(f"kvsvc-stream-{uuid.uuid4().hex}", secrets.token_hex(16))


def prefill_stream_params(order: StreamOrder) -> dict[str, Any]:
    """P's kv_transfer_params for a streamed request."""
    return {"do_remote_decode": True, "do_remote_prefill": False,
            STREAM_KEY: {"lease_id": order.lease_id, "lease_token": order.token}}


def stream_order(params: Mapping[str, Any] | None) -> StreamOrder | None:
    """The stream order in P's kv_transfer_params; None when there is none. ValueError
    when there is one that cannot be used (the request then is not streamed)."""
    raw = (params or {}).get(STREAM_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{STREAM_KEY} must be an object")
    lease_id, token = raw.get("lease_id"), raw.get("lease_token")
    if not (isinstance(lease_id, str) and 0 < len(lease_id) <= MAX_LEASE_ID_CHARS and lease_id.isascii()
            and lease_id.isprintable()):
        raise ValueError(f"{STREAM_KEY}.lease_id must be 1 to {MAX_LEASE_ID_CHARS} printable ASCII characters")
    if not (isinstance(token, str) and _TOKEN.fullmatch(token)):
        raise ValueError(f"{STREAM_KEY}.lease_token must be 32 lowercase hex digits")
    return StreamOrder(lease_id, token)


def identity(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a kvsvc P engine's answer says of the engine itself (not of the request), kept by a
    router to name that engine's leases-to-be; None for params that are not kvsvc's."""
    if not params or not isinstance(params.get(KEY), Mapping):
        return None
    inner = {k: v for k, v in params[KEY].items() if k not in _PER_REQUEST}
    if not inner.get("remote_servers") and not inner.get("remote_address"):
        return None
    return {"remote_engine_id": params.get("remote_engine_id"), "tp_size": params.get("tp_size"),
            "dcp_size": params.get("dcp_size"), KEY: inner}


def decode_stream_params(ident: Mapping[str, Any], order: StreamOrder) -> dict[str, Any]:
    """D's kv_transfer_params for a streamed request: the lease-to-be on the P engine ident
    describes (the request's length comes from D's own prompt: P leases all of it)."""
    inner = {**ident[KEY], "remote_request_id": order.lease_id, "lease_token": order.token,
             "lease_pending": True, "progressive": True}
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ident["remote_engine_id"],
            "remote_request_id": order.lease_id, "remote_num_tokens": 0, "tp_size": ident["tp_size"],
            "dcp_size": ident["dcp_size"], KEY: inner}


def is_streamed(params: Mapping[str, Any] | None) -> bool:
    """D: params naming a streamed lease (the request's length is D's own prompt's)."""
    inner = (params or {}).get(KEY)
    return isinstance(inner, Mapping) and bool(inner.get("progressive"))
