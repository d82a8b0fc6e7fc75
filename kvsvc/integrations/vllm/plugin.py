"""kvsvc's vLLM plugin (entry point `vllm.general_plugins`): the connector's settings checked
when vLLM starts, not minutes later.

vLLM makes a KV connector only once the model is loaded (its KV cache is sized after the
weights), so a misspelt key in kv_connector_extra_config used to be reported only then (363 s
in with a small model on CPU). vLLM loads its general plugins in every process, first in the
API server before it parses its arguments: there this reads --kv-transfer-config from the
command line and, when it names KvsvcConnector, checks kv_connector_extra_config as the
connector will (extra_config.py), exiting with what is wrong. Anything it cannot read (no
such argument, JSON vLLM will refuse itself, the Python API, another connector) it leaves
to vLLM and to the connector's own check.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from kvsvc.integrations.vllm.extra_config import CONNECTOR, WHERE, checked_extra

_FLAGS = ("--kv-transfer-config", "--kv_transfer_config")


def kv_transfer_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """--kv-transfer-config's JSON object from a command line (the last one given), or None."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _FLAGS:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if found is None:
        return None
    try:
        conf = json.loads(found)
    except ValueError:
        return None  # vLLM's own parser says what is wrong with it
    return conf if isinstance(conf, dict) else None


def check_arguments(argv: Sequence[str] | None = None) -> None:
    """The plugin: SystemExit naming the problem when the command line's KvsvcConnector config
    would be refused by the connector."""
    conf = kv_transfer_config(sys.argv[1:] if argv is None else argv)
    if conf is None or conf.get("kv_connector") != CONNECTOR:
        return
    extra = conf.get(WHERE) or {}
    if not isinstance(extra, dict):
        raise SystemExit(f"kvsvc: {WHERE} must be a JSON object, not {type(extra).__name__}")
    try:
        checked_extra(extra)
    except ValueError as e:
        raise SystemExit(f"kvsvc: {e} (checked as vLLM starts, before the model loads)") from None
