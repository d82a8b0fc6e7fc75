"""kvsvc as vLLM's KV connector: kv_connector "KvsvcConnector", module path "kvsvc.integrations.vllm".

The connector class is loaded on first use, so that the parts that need no vLLM (the
event-loop thread, the params and layout helpers) import without it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvsvcConnector":
        from kvsvc.integrations.vllm.connector import KvsvcConnector

        return KvsvcConnector
    raise AttributeError(name)


__all__ = ["KvsvcConnector"]
