"""AMX tile data for engines kvsvc's connector is not loaded into (vLLM's NixlConnector).

Put on an engine's PYTHONPATH (tests.vllm.served.vllm_serve does, on a CPU with AMX), Python
imports this at the start of every process of the engine -- the API server and each worker
it spawns. vLLM 0.32's bf16 CPU attention uses AMX tiles without asking Linux for them, and a
worker whose first forward is a decode engine's one recomputed token dies there with SIGILL;
kvsvc's connector asks in its worker itself (kvsvc.integrations.amx), another connector does
not. Comparing the two, both engines hold the same permission.
"""

from kvsvc.integrations.amx import request_amx

request_amx()
