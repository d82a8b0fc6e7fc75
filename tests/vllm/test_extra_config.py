"""kv_connector_extra_config is checked when the connector starts: an unknown key or a value
of the wrong type is refused, naming it, instead of being ignored."""

from __future__ import annotations

import pytest

from kvsvc.integrations.vllm.connector import _checked_extra


def test_known_keys_are_read_as_their_types():
    extra = _checked_extra({"listen_host": "0.0.0.0", "lease_ttl_s": 60, "allowed_peers": ["p"], "copy_threads": 0})
    assert extra.listen_host == "0.0.0.0"
    assert dict(extra.server) == {"lease_ttl_s": 60.0, "allowed_peers": ("p",), "copy_threads": 0}


@pytest.mark.parametrize("extra, named", [
    ({"lease_ttl": 60}, "lease_ttl"),                  # misspelt: used to be ignored
    ({"lease_ttl_s": "60"}, "lease_ttl_s"),            # a string is not a number
    ({"allowed_peers": "p"}, "allowed_peers"),
    ({"listen_host": 7}, "listen_host"),
    ({"progressive": True}, "progressive"),            # vLLM streams per request (the router), not per engine
])
def test_an_unknown_key_or_a_wrong_type_is_refused_by_name(extra, named):
    with pytest.raises(ValueError) as e:
        _checked_extra(extra)
    assert named in str(e.value)


def _vllm_config(name_or_path: str, layers: int = 2, spec=None):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    hf = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     architectures=["LlamaForCausalLM"])  # as a config.json on disk says
    hf._name_or_path = name_or_path
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, model=name_or_path, dtype="torch.bfloat16"),
                           cache_config=SimpleNamespace(cache_dtype="auto"), speculative_config=spec)


def test_the_model_identity_is_the_model_not_its_path():
    from types import SimpleNamespace

    from kvsvc.integrations.vllm.connector import _model_id

    p = _model_id(_vllm_config("/models/llama"))
    assert p == _model_id(_vllm_config("/mnt/weights/llama-copy"))  # same weights, another mount
    assert p.startswith("LlamaForCausalLM@")
    assert p != _model_id(_vllm_config("/models/llama", layers=3))
    assert p != _model_id(_vllm_config("/models/llama", spec=SimpleNamespace(method="eagle",
                                                                             num_speculative_tokens=3)))
    assert _model_id(_vllm_config("/models/llama"), "llama-3-8b") == "llama-3-8b"


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "prefill_context_parallel_size"])
def test_unsupported_parallelism_is_refused_at_start(name):
    from types import SimpleNamespace

    from kvsvc.integrations.vllm.connector import check_parallelism

    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, prefill_context_parallel_size=1,
                                      decode_context_parallel_size=2))
    with pytest.raises(ValueError, match=name):
        check_parallelism(SimpleNamespace(**{"pipeline_parallel_size": 1, "prefill_context_parallel_size": 1,
                                             name: 2}))


@pytest.mark.parametrize("extra", [{"listen_port": -1}, {"listen_port": 70000}, {"listen_port": "9000"},
                                   {"model_id": ""}, {"model_id": 7}])
def test_bad_port_or_model_id_is_refused(extra):
    with pytest.raises(ValueError, match=next(iter(extra))):
        _checked_extra(extra)


def test_a_fixed_listen_port_is_base_plus_rank():
    import socket

    import torch

    from kvsvc.config import Role
    from kvsvc.integrations.description import CacheDescription
    from kvsvc.integrations.vllm.worker import KvsvcWorker
    from kvsvc.layout import layout_from_dict
    from kvsvc.layout.regions import build_pool_layout

    table = {"model_id": "fp", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 8, "dtype": "bfloat16",
             "groups": [{"name": "full", "kind": "full_attention", "num_layers": 1, "head_size": 64}]}
    regions = build_pool_layout(layout_from_dict(table, tp_size=2)).regions
    with socket.socket() as s:  # a base whose rank-1 port is free now
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1] - 1
    w = KvsvcWorker(engine_id="fp", role=Role.DECODE, tp_rank=1, tp_size=2, listen_port=base)
    try:
        info = w.start(CacheDescription(layout_from_dict(table, tp_size=2), [torch.zeros((r.num_blocks, r.block_len), dtype=torch.uint8)
                                                for r in regions]))
        assert info.address == f"127.0.0.1:{base + 1}"
    finally:
        w.shutdown()


def test_the_plugin_reads_the_connector_config_from_the_command_line():
    from kvsvc.integrations.vllm.plugin import check_arguments, kv_transfer_config

    conf = '{"kv_connector": "KvsvcConnector", "kv_connector_extra_config": {"listen_port": 5000}}'
    assert kv_transfer_config(["--model", "m", "--kv-transfer-config", conf])["kv_connector"] == "KvsvcConnector"
    assert kv_transfer_config([f"--kv_transfer_config={conf}"]) is not None
    assert kv_transfer_config(["--kv-transfer-config", "{not json"]) is None  # vLLM says what is wrong
    assert kv_transfer_config(["--model", "m"]) is None
    check_arguments(["--kv-transfer-config", conf])  # a good config passes
    check_arguments(["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_connector_extra_config": '
                                             '{"anything": 1}}'])  # another connector's: not ours to check
    with pytest.raises(SystemExit) as e:
        check_arguments(["--kv-transfer-config", conf.replace("listen_port", "listen_prot")])
    assert "listen_prot" in str(e.value) and "before the model loads" in str(e.value)


def test_vllm_refuses_a_misspelt_connector_setting_as_it_starts_not_after_loading_the_model(tmp_path):
    """vLLM's own server, started as a user does, with a misspelt key: it exits naming the key,
    from kvsvc's plugin, before it reads the model (whose path does not even exist)."""
    import json
    import subprocess
    import sys
    import time

    conf = {"kv_connector": "KvsvcConnector", "kv_connector_module_path": "kvsvc.integrations.vllm",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"lease_ttl": 60}}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                           str(tmp_path / "no-such-model"), "--kv-transfer-config", json.dumps(conf)],
                          capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    assert done.returncode != 0
    assert "lease_ttl" in done.stderr and "before the model loads" in done.stderr, done.stderr[-3000:]
    print(f"refused in {took:.1f} s")
