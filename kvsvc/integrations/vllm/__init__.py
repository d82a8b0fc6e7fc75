"""kvsvc as vLLM's KV connector: kv_connector "KvsvcConnector", module path "kvsvc.integrations.vllm"."""

from kvsvc.integrations.vllm.connector import KvsvcConnector

__all__ = ["KvsvcConnector"]
