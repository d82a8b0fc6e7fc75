"""The kv_transfer_params of streamed vLLM requests: what a router sends P and D.

D's params are built from what an earlier answer of P said of P; they must parse as kvsvc's
TransferParams (the D connector's reader, not this module's) and name the lease-to-be.
"""

from __future__ import annotations

import pytest

from kvsvc.client.params import params_from_json
from kvsvc.integrations.vllm import stream_params

P_ANSWER = {  # what a P engine answered for an earlier request (vLLM's fields and kvsvc's)
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-earlier-0", "remote_num_tokens": 40, "tp_size": 2, "dcp_size": 1,
    "kvsvc": {"remote_address": "10.0.0.1:7000", "remote_engine_id": "p-engine", "remote_request_id": "cmpl-earlier-0",
              "remote_block_ids_per_group": [{"block_ids": [3, 4]}], "remote_epoch": "99", "remote_tp_size": 2,
              "lease_token": "ab" * 16, "lease_pending": True, "remote_num_tokens": "40", "remote_dcp_size": 1,
              "remote_servers": [{"address": "10.0.0.1:7000", "ranks": [0], "epoch": "99"},
                                 {"address": "10.0.0.1:7001", "ranks": [1], "epoch": "98"}]},
}


def test_d_params_name_the_lease_to_be_on_the_servers_p_named():
    order = stream_params.new_stream()
    ident = stream_params.identity(P_ANSWER)
    assert ident is not None
    d = stream_params.decode_stream_params(ident, order)
    parsed = params_from_json(d["kvsvc"])
    assert parsed.remote_request_id == order.lease_id == d["remote_request_id"]
    assert parsed.lease_token == order.token and parsed.lease_pending and parsed.progressive
    assert [(s.address, s.epoch, list(s.ranks)) for s in parsed.remote_servers] == [
        ("10.0.0.1:7000", 99, [0]), ("10.0.0.1:7001", 98, [1])]
    assert not parsed.remote_block_ids_per_group and parsed.remote_num_tokens == 0  # nothing of the earlier request
    assert d["do_remote_prefill"] and d["tp_size"] == 2 and stream_params.is_streamed(d)
    assert not stream_params.is_streamed(P_ANSWER)


def test_p_reads_back_the_order_the_router_sent():
    order = stream_params.new_stream()
    assert stream_params.stream_order(stream_params.prefill_stream_params(order)) == order
    assert stream_params.stream_order({"do_remote_decode": True}) is None
    assert stream_params.new_stream() != order  # each request its own lease


@pytest.mark.parametrize("bad", [
    "not an object", {"lease_id": "", "lease_token": "ab" * 16}, {"lease_id": "x" * 129, "lease_token": "ab" * 16},
    {"lease_id": "x\n", "lease_token": "ab" * 16}, {"lease_id": "é", "lease_token": "ab" * 16},
    {"lease_id": "x", "lease_token": "AB" * 16}, {"lease_id": "x", "lease_token": "ab"}, {"lease_id": 3, "lease_token": 4},
])
def test_a_malformed_order_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="kvsvc_stream"):
        stream_params.stream_order({"do_remote_decode": True, "kvsvc_stream": bad})


def test_answers_that_are_not_kvsvc_name_no_engine():
    assert stream_params.identity(None) is None
    assert stream_params.identity({"do_remote_prefill": True}) is None
    assert stream_params.identity({"kvsvc": {"lease_token": "x"}}) is None  # no server named
