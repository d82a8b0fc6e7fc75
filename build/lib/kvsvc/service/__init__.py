"""Layer 6: the grpc.aio servicer, error mapping, health, reflection and lifecycle."""
