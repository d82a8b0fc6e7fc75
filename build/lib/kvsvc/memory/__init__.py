"""Layer 3: KV pools (shared-memory DRAM, CUDA VRAM, engine-owned buffers)."""
