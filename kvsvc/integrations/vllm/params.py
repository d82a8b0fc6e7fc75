"""kv_transfer_params: what P's request_finished hands a router, and D's connector reads back.

A JSON-able dict with vLLM's own fields (so routers and vLLM's output processing
treat it like any connector's) and kvsvc's TransferParams under KEY, as proto JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.client.params import params_from_json, params_to_dict
from kvsvc.errors import InvalidArgument
from kvsvc.reasons import Reason
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


def pending_params(*, engine_id: str, request_id: str, block_ids: Sequence[Sequence[int]],
                   servers: Sequence[tuple[str, int, int]], token: str, num_tokens: int, tp_size: int,
                   dcp_size: int) -> dict[str, Any]:
    """The params P's scheduler hands out before its workers lease the blocks (lease_pending):
    the same JSON as to_vllm(TransferParams(...)) gives, built directly -- protobuf's
    MessageToDict took three quarters of request_finished's time, on vLLM's engine thread.
    servers: (address, epoch, tp_rank) of each worker's server, in rank order."""
    address, epoch, _ = servers[0]
    kvsvc: dict[str, Any] = {
        "remote_address": address, "remote_engine_id": engine_id, "remote_request_id": request_id,
        "remote_block_ids_per_group": [{"block_ids": [int(b) for b in g]} if len(g) else {} for g in block_ids],
        "remote_epoch": str(epoch), "remote_tp_size": tp_size, "lease_token": token,
        "remote_servers": [{"address": a, "ranks": [r], "epoch": str(e)} for a, e, r in servers],
        "remote_dcp_size": dcp_size, "lease_pending": True}
    if num_tokens:
        kvsvc["remote_num_tokens"] = str(num_tokens)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_num_tokens": num_tokens, "tp_size": tp_size,
            "dcp_size": dcp_size, KEY: kvsvc}


def is_kvsvc(params: Mapping[str, Any] | None) -> bool:
    """True for params a kvsvc prefill engine made (do_remote_prefill, with kvsvc's TransferParams)."""
    return bool(params) and bool(params.get("do_remote_prefill")) and isinstance(params.get(KEY), dict)  # type: ignore[union-attr]


def from_vllm(params: Mapping[str, Any]) -> pb.TransferParams:
    """The TransferParams inside; INVALID_ARGUMENT / BAD_TRANSFER_PARAMS when they do not parse."""
    raw = params.get(KEY)
    if not isinstance(raw, dict):
        raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, f"kv_transfer_params has no {KEY!r} object", {"key": KEY})
    try:
        return params_from_json(raw)  # either spelling of each field: remote_address or remoteAddress
    except InvalidArgument as e:
        raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, f"kv_transfer_params[{KEY!r}]: {e.message}"[:300],
                              {"key": KEY}) from e


NULL_BLOCK = 0  # vLLM's placeholder for a block a group does not keep (out of a sliding window)


def block_lists(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """vLLM's block ids per group as kvsvc takes them: without the null blocks that stand for
    the blocks a sliding-window group let go (a prefix of its list), so a group lists the
    blocks it holds, and both sides line them up from the end."""
    return [[int(b) for b in group if b != NULL_BLOCK] for group in block_ids]
