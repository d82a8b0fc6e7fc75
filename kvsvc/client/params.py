"""TransferParams as JSON, for routers that carry them between a prefill and a decode engine.

The JSON form is protobuf's canonical one with the .proto's field names (`remote_address`,
`remote_block_ids_per_group`, ...; uint64 fields as strings). Reading accepts either
spelling of every field -- the .proto's or protobuf JSON's lowerCamelCase (`remoteAddress`)
-- so params that passed through grpcurl, grpc-gateway or a JavaScript router parse the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from kvsvc.errors import InvalidArgument
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

MAX_PARAMS_JSON_BYTES = 16 * 1024 * 1024


def params_to_dict(params: pb.TransferParams) -> dict[str, Any]:
    return json_format.MessageToDict(params, preserving_proto_field_name=True)


def params_to_json(params: pb.TransferParams) -> str:
    return json.dumps(params_to_dict(params), separators=(",", ":"))


def params_from_json(data: str | bytes | Mapping[str, Any]) -> pb.TransferParams:
    """TransferParams from JSON text or an already-parsed dict; BAD_TRANSFER_PARAMS when they
    do not parse (unknown field, wrong type, too big)."""
    if isinstance(data, (str, bytes)):
        if len(data) > MAX_PARAMS_JSON_BYTES:
            raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, f"TransferParams JSON of {len(data)} bytes "
                                  f"(max {MAX_PARAMS_JSON_BYTES})", {"bytes": len(data)})
        try:
            data = json.loads(data)
        except ValueError as e:
            raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, f"TransferParams are not JSON: {e}"[:300]) from e
    if not isinstance(data, Mapping):
        raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, "TransferParams JSON must be an object")
    try:
        return json_format.ParseDict(dict(data), pb.TransferParams())
    except json_format.ParseError as e:
        raise InvalidArgument(Reason.BAD_TRANSFER_PARAMS, f"TransferParams do not parse: {e}"[:300]) from e
