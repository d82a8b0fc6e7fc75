"""kv_transfer_params: what P's request_finished hands a router, and D's connector reads back.

A JSON-able dict with vLLM's own fields (so routers and vLLM's output processing
treat it like any connector's) and kvsvc's TransferParams under KEY, as proto JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.client.params import params_from_json, params_to_dict
from kvsvc.errors import InvalidArgument
from kvsvc.v1 import kv_transfer_pb2 as pb

KEY = "kvsvc"


def to_vllm(params: pb.TransferParams, *, num_tokens: int, tp_size: int, dcp_size: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": params.remote_engine_id,
        "remote_request_id": params.remote_request_id,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "dcp_size": dcp_size,
        KEY: params_to_dict(params),
    }


def is_kvsvc(params: Mapping[str, Any] | None) -> bool:
    """True for params a kvsvc prefill engine made (do_remote_prefill, with kvsvc's TransferParams)."""
    return bool(params) and bool(params.get("do_remote_prefill")) and isinstance(params.get(KEY), dict)  # type: ignore[union-attr]


def from_vllm(params: Mapping[str, Any]) -> pb.TransferParams:
    """The TransferParams inside; INVALID_ARGUMENT / BAD_TRANSFER_PARAMS when they do not parse."""
    raw = params.get(KEY)
    if not isinstance(raw, dict):
        raise InvalidArgument("BAD_TRANSFER_PARAMS", f"kv_transfer_params has no {KEY!r} object", {"key": KEY})
    try:
        return params_from_json(raw)  # either spelling of each field: remote_address or remoteAddress
    except InvalidArgument as e:
        raise InvalidArgument("BAD_TRANSFER_PARAMS", f"kv_transfer_params[{KEY!r}]: {e.message}"[:300],
                              {"key": KEY}) from e


def block_lists(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(b) for b in group] for group in block_ids]
