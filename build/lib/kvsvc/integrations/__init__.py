"""kvsvc inside inference engines (vllm: a KV connector for vLLM)."""
