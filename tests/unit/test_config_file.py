"""The TOML config file: every [server] key read as its field's type, strictly; unknown keys
and layout keys named, never ignored."""

from __future__ import annotations

import pytest

from kvsvc.config import MemoryMode, Role, ServerConfig, load_config
from kvsvc.errors import InvalidArgument


def _load(tmp_path, text: str) -> ServerConfig:
    path = tmp_path / "kvsvc.toml"
    path.write_text(text)
    return load_config(path)


def test_every_field_is_read_as_its_type(tmp_path):
    cfg = _load(tmp_path, """
[server]
listen = "127.0.0.1:0"
role = "decode"
memory = "none"
tp_size = 2
ranks = [1]
lease_ttl_s = 5            # an integer is a number of seconds too
max_leased_blocks = 1024   # a field added later needs no list of keys to be read
max_claims_per_engine = 7
transfer_socket = false
allowed_peers = ["p1", "p2"]
""")
    assert (cfg.role, cfg.memory, cfg.tp_size, cfg.ranks) == (Role.DECODE, MemoryMode.NONE, 2, (1,))
    assert cfg.lease_ttl_s == 5.0 and isinstance(cfg.lease_ttl_s, float)
    assert (cfg.max_leased_blocks, cfg.max_claims_per_engine, cfg.transfer_socket) == (1024, 7, False)
    assert cfg.allowed_peers == ("p1", "p2")


@pytest.mark.parametrize("line, key", [
    ('tp_size = "2"', "server.tp_size"),            # a string is not an integer
    ("tp_size = 2.5", "server.tp_size"),
    ("tp_size = true", "server.tp_size"),           # nor is a bool
    ("lease_ttl_s = true", "server.lease_ttl_s"),
    ("engine_id = 7", "server.engine_id"),          # a number is not a string
    ('transfer_socket = "no"', "server.transfer_socket"),
    ('role = "prefil"', "server.role"),
    ('ranks = [0, "1"]', "server.ranks[1]"),
    ('allowed_peers = "p1"', "server.allowed_peers"),
])
def test_a_value_of_another_type_is_named(tmp_path, line, key):
    with pytest.raises(InvalidArgument) as e:
        _load(tmp_path, f"[server]\n{line}\n")
    assert e.value.reason == "INVALID_CONFIG" and e.value.metadata["key"] == key


def test_layout_keys_are_checked_too(tmp_path):
    with pytest.raises(InvalidArgument) as e:
        _load(tmp_path, "[layout]\nnum_block = 4096\n")
    assert e.value.reason == "UNKNOWN_LAYOUT_KEY" and e.value.metadata["unknown"] == "num_block"
