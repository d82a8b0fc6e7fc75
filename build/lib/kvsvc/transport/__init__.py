"""Layer 4: the NIXL boundary (one thread for every NIXL call, an idle-sleeping progress pump)."""
