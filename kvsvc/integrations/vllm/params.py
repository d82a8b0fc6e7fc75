"""kv_transfer_params: what P's request_finished hands a router, and D's connector reads back.

A JSON-able dict with vLLM's own fields (so routers and vLLM's output processing
treat it like any connector's) and kvsvc's TransferParams under KEY, as proto JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

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
        KEY: json_format.MessageToDict(params, preserving_proto_field_name=True),
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
        return json_format.ParseDict(raw, pb.TransferParams())
    except json_format.ParseError as e:
        raise InvalidArgument("BAD_TRANSFER_PARAMS", f"kv_transfer_params[{KEY!r}] does not parse: {e}"[:300],
                              {"key": KEY}) from e


def block_lists(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(b) for b in group] for group in block_ids]
