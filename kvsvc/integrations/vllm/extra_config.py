"""kv_connector_extra_config, checked: the connector's settings read strictly (an unknown key
or a value of the wrong type is refused, naming it) -- by the connector when vLLM makes it,
and by kvsvc's vLLM plugin (plugin.py) when vLLM starts, before the model loads."""

from __future__ import annotations

from typing import Any

from kvsvc.integrations.settings import EngineSettings

WHERE = "kv_connector_extra_config"
CONNECTOR = "KvsvcConnector"


def checked_extra(extra: dict[str, Any]) -> EngineSettings:
    """The settings; ValueError naming what is wrong."""
    settings = EngineSettings.from_mapping(extra, WHERE)
    if settings.progressive:
        raise ValueError(f"{WHERE}.progressive: a vLLM engine streams a request whenever its router sends "
                         "it to P and D at once (kvsvc's router: --progressive; docs/VLLM.md), with no engine "
                         "setting; leave it out")
    return settings
