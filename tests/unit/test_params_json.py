"""TransferParams' JSON form for routers: proto field names out, either spelling in."""

from __future__ import annotations

import json

import pytest

from kvsvc.client.params import params_from_json, params_to_json
from kvsvc.errors import InvalidArgument
from kvsvc.integrations.vllm.params import from_vllm

SNAKE = {"remote_address": "10.0.0.5:50051", "remote_engine_id": "prefill-0", "remote_request_id": "req-1",
         "remote_block_ids_per_group": [{"block_ids": [3, 5, 7]}], "remote_epoch": "18446744073709551615",
         "remote_tp_size": 2, "lease_token": "t0k", "remote_servers": [{"address": "10.0.0.6:50051", "ranks": [1],
                                                                       "epoch": "9"}],
         "remote_dcp_size": 1, "remote_num_tokens": "48"}
CAMEL = {"remoteAddress": "10.0.0.5:50051", "remoteEngineId": "prefill-0", "remoteRequestId": "req-1",
         "remoteBlockIdsPerGroup": [{"blockIds": [3, 5, 7]}], "remoteEpoch": "18446744073709551615",
         "remoteTpSize": 2, "leaseToken": "t0k", "remoteServers": [{"address": "10.0.0.6:50051", "ranks": [1],
                                                                    "epoch": "9"}],
         "remoteDcpSize": 1, "remoteNumTokens": "48"}


def test_both_spellings_read_the_same_and_write_proto_names():
    a, b = params_from_json(json.dumps(SNAKE)), params_from_json(CAMEL)
    assert a == b
    assert a.remote_epoch == 2**64 - 1 and list(a.remote_block_ids_per_group[0].block_ids) == [3, 5, 7]
    assert a.remote_servers[0].epoch == 9 and a.remote_num_tokens == 48
    assert json.loads(params_to_json(b)) == SNAKE  # the documented form: proto names, uint64 as strings


def test_vllm_kv_transfer_params_accept_either_spelling():
    assert from_vllm({"kvsvc": CAMEL}) == from_vllm({"kvsvc": SNAKE})


@pytest.mark.parametrize("bad", ['{"remote_address": 5', '[1, 2]', '{"no_such_field": 1}',
                                 '{"remote_epoch": "-1"}', "x" * (16 * 1024 * 1024 + 1)])
def test_bad_params_json_is_a_typed_error(bad):
    with pytest.raises(InvalidArgument) as e:
        params_from_json(bad)
    assert e.value.reason == "BAD_TRANSFER_PARAMS"
