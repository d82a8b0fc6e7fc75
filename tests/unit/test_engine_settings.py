"""EngineSettings: kvsvc's settings inside an engine, read the same strict way from vLLM's
kv_connector_extra_config and from SGLang's environment."""

from __future__ import annotations

import pytest

from kvsvc.integrations.settings import EngineSettings

WHERE = "kv_connector_extra_config"


def test_known_keys_are_read_as_their_types_and_server_keys_checked_as_the_toml_file_s():
    s = EngineSettings.from_mapping({"listen_host": "0.0.0.0", "listen_port": 5000, "transfer_timeout_s": 30,
                                     "lease_ttl_ms": 2000.0, "lease_ttl_s": 60, "allowed_peers": ["p"],
                                     "copy_threads": 0}, WHERE)
    assert (s.listen_host, s.listen_port, s.transfer_timeout_s, s.lease_ttl_ms) == ("0.0.0.0", 5000, 30.0, 2000)
    assert isinstance(s.transfer_timeout_s, float) and isinstance(s.lease_ttl_ms, int)
    assert dict(s.server) == {"lease_ttl_s": 60.0, "allowed_peers": ("p",), "copy_threads": 0}
    assert EngineSettings.from_mapping({}, WHERE) == EngineSettings()


@pytest.mark.parametrize("values, named", [
    ({"lease_ttl": 60}, "lease_ttl"),  # misspelt: named with the keys kvsvc takes
    ({"lease_ttl_s": "60"}, "lease_ttl_s"),  # a server key of the wrong type
    ({"allowed_peers": "p"}, "allowed_peers"),
    ({"listen_host": 7}, "listen_host"),
    ({"listen_port": True}, "listen_port"),
    ({"listen_port": 70_000}, "listen_port"),
    ({"lease_ttl_ms": 1.5}, "lease_ttl_ms"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
    ({"stream_timeout_s": -5}, "stream_timeout_s"),
    ({"stream_timeout_s": 86_400}, "stream_timeout_s"),
    ({"lease_heartbeat_s": -1}, "lease_heartbeat_s"),
    ({"model_id": "m" * 201}, "model_id"),
    ({"progressive": 1}, "progressive"),  # true or false, not a number
    ({"progressive": "yes"}, "progressive"),
])
def test_an_unknown_key_or_a_wrong_value_is_refused_by_name(values, named):
    with pytest.raises(ValueError) as e:
        EngineSettings.from_mapping(values, WHERE)
    assert named in str(e.value)


def test_the_environment_is_read_the_same_way():
    env = {"KVSVC_SGLANG_TRANSFER_TIMEOUT_S": "45", "KVSVC_SGLANG_LEASE_TTL_MS": "3000",
           "KVSVC_SGLANG_CONFIG": "/etc/kvsvc.toml", "KVSVC_SGLANG_MODEL_ID": "123",
           "KVSVC_SGLANG_ALLOWED_ENGINES": '["d-1", "d-2"]', "KVSVC_SGLANG_LISTEN_HOST": "0.0.0.0",
           "OTHER": "x", "KVSVC_OTHER": "y"}
    s = EngineSettings.from_environment(env, "KVSVC_SGLANG_")
    assert (s.transfer_timeout_s, s.lease_ttl_ms, s.config, s.model_id) == (45.0, 3000, "/etc/kvsvc.toml", "123")
    assert s.listen_host == "0.0.0.0" and dict(s.server) == {"allowed_engines": ("d-1", "d-2")}
    for bad, named in (({"KVSVC_SGLANG_TRANSFER_TIMEOUT": "45"}, "transfer_timeout"),
                       ({"KVSVC_SGLANG_LEASE_TTL_MS": "soon"}, "lease_ttl_ms")):
        with pytest.raises(ValueError) as e:
            EngineSettings.from_environment(bad, "KVSVC_SGLANG_")
        assert named in str(e.value) and "KVSVC_SGLANG_" in str(e.value)


def test_progressive_is_a_boolean_read_from_the_environment_as_json():
    assert EngineSettings.from_environment({"KVSVC_SGLANG_PROGRESSIVE": "true"}, "KVSVC_SGLANG_").progressive
    assert not EngineSettings.from_environment({"KVSVC_SGLANG_PROGRESSIVE": "false"}, "KVSVC_SGLANG_").progressive
    with pytest.raises(ValueError) as e:
        EngineSettings.from_environment({"KVSVC_SGLANG_PROGRESSIVE": "1"}, "KVSVC_SGLANG_")
    assert "progressive" in str(e.value)


def test_a_streamed_load_s_deadline_is_stream_timeout_s_and_never_shorter_than_a_pulled_one_s():
    s = EngineSettings.from_environment({"KVSVC_SGLANG_STREAM_TIMEOUT_S": "300", "KVSVC_SGLANG_TRANSFER_TIMEOUT_S": "30"},
                                        "KVSVC_SGLANG_")
    assert (s.timeout_for(progressive=False), s.timeout_for(progressive=True)) == (30, 300)
    assert EngineSettings().timeout_for(progressive=True) == 600  # P's queue and prefill: the router's bound on P
    assert EngineSettings(transfer_timeout_s=900, stream_timeout_s=300).timeout_for(progressive=True) == 900
