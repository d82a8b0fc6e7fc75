"""Layer 7: the kvsvc command line."""
