"""kv_connector_extra_config is checked when the connector starts: an unknown key or a value
of the wrong type is refused, naming it, instead of being ignored."""

from __future__ import annotations

import pytest

from kvsvc.integrations.vllm.connector import _checked_extra


def test_known_keys_are_read_as_their_types():
    extra = _checked_extra({"listen_host": "0.0.0.0", "lease_ttl_s": 60, "allowed_peers": ["p"], "copy_threads": 0})
    assert extra == {"listen_host": "0.0.0.0", "lease_ttl_s": 60.0, "allowed_peers": ("p",), "copy_threads": 0}


@pytest.mark.parametrize("extra, named", [
    ({"lease_ttl": 60}, "lease_ttl"),                  # misspelt: used to be ignored
    ({"lease_ttl_s": "60"}, "lease_ttl_s"),            # a string is not a number
    ({"allowed_peers": "p"}, "allowed_peers"),
    ({"listen_host": 7}, "listen_host"),
])
def test_an_unknown_key_or_a_wrong_type_is_refused_by_name(extra, named):
    with pytest.raises(ValueError) as e:
        _checked_extra(extra)
    assert named in str(e.value)
