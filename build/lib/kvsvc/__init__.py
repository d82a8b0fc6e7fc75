"""kvsvc: KV-cache transfer service for disaggregated prefill/decode inference."""

__version__ = "0.1.0"
