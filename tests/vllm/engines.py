"""Real vLLM engines for the tests: each in its own process group, driven by engine_proc.

The model is a small random-weight Llama written at test time (no downloads). Engines
run unbound with one OpenMP thread per worker, so several share two cores.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvsvc.integrations.amx import cpu_has_amx

ROOT = Path(__file__).resolve().parents[2]
KVSVC = {"kv_connector": "KvsvcConnector", "kv_connector_module_path": "kvsvc.integrations.vllm"}


def write_model(path: Path, max_positions: int = 1024) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def write_mla_model(path: Path) -> None:
    """A small random-weight DeepSeek-V2-style model: MLA attention (latent 512 + rope 64, the
    sizes vLLM's CPU MLA kernel takes), dense MLPs only."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                           qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=2,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           max_position_embeddings=1024)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


@functools.cache
def kernel_block_size(*, mla: bool = False, head_size: int = 64) -> int:
    """The smallest block size the attention backend vLLM picks on this machine takes for a
    bf16 model (MLA or not): no test hard-codes one. On CPU: 32 for CPU_ATTN; 16 for CPU_MLA,
    32 for AMX_MLA where the CPU has AMX."""
    import importlib

    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.selector import AttentionSelectorConfig

    path = current_platform.get_attn_backend_cls(None, AttentionSelectorConfig(
        head_size=576 if mla else head_size, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None, use_mla=mla))
    module, _, name = path.rpartition(".")
    first = getattr(importlib.import_module(module), name).get_supported_kernel_block_sizes()[0]
    return first.base if isinstance(first, MultipleOf) else int(first)


def kvsvc_servers(log: Path) -> list[str]:
    """The addresses an engine's embedded kvsvc servers logged (one per worker)."""
    return sorted(set(re.findall(r"kvsvc: rank \d+ serves its KV at (\S+)", log.read_text(errors="replace"))))


def assert_servers_gone(name: str, log: Path) -> None:
    """None of a stopped engine's kvsvc servers may still accept connections."""
    alive = [a for a in kvsvc_servers(log) if still_serving(a)]
    assert not alive, f"kvsvc servers of {name} outlived it: {alive}"


_SIDE_CHANNEL_PORTS_GIVEN: set[int] = set()


def side_channel_ports(count: int) -> int:
    """The first of `count` consecutive free ports for NixlConnector's side channel (it listens on
    base + TP rank), below Linux's ephemeral range, so that no port-0 socket (kvsvc servers,
    HTTP clients) can take one before the engine binds it."""
    rng = random.SystemRandom()
    while True:
        base = rng.randrange(20000, 32000 - count)
        if any(base + i in _SIDE_CHANNEL_PORTS_GIVEN for i in range(count)):
            continue  # given to an engine that may not have bound it yet
        try:
            held = [socket.create_server(("127.0.0.1", base + i)) for i in range(count)]
        except OSError:
            continue
        for s in held:
            s.close()
        _SIDE_CHANNEL_PORTS_GIVEN.update(range(base, base + count))
        return base


def _free_port() -> int:
    """A port for an HTTP server started later (vLLM's API server, the router): chosen as the
    side channel's are, never given twice in a session. A port-0 probe, closed at once, can
    hand two servers started back to back the same port; vLLM's server binds with
    SO_REUSEPORT, so both then listen and the kernel splits the requests between them (P and
    D did exactly that in one CI run)."""
    return side_channel_ports(1)


def still_serving(address: str, grace_s: float = 15.0) -> bool:
    """Whether something still accepts connections at address after grace_s (a killed process
    closes its sockets only once it has exited, which takes a moment)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                pass
        except OSError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


AMX_SITE = Path(__file__).resolve().parent / "amx_site"


def amx_site(connector: dict[str, Any] | None) -> dict[str, str]:
    """PYTHONPATH for a PD engine whose connector is not kvsvc's, on a CPU with AMX: its
    processes ask for AMX tile data at start (amx_site/sitecustomize.py), as kvsvc's connector
    does in its worker -- else its decode worker dies on its first, one-token forward."""
    if not connector or connector.get("kv_connector") == KVSVC["kv_connector"] or not cpu_has_amx():
        return {}
    return {"PYTHONPATH": f"{AMX_SITE}{os.pathsep}{ROOT}"}


class Engine:
    """One vLLM engine (LLM) in a process of its own; generate() returns its outputs."""

    def __init__(self, name: str, model: Path, logs: Path, *, tp: int = 1,
                 connector: dict[str, Any] | None = None, engine_args: dict[str, Any] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.name = name
        # Unbound, one OpenMP thread per worker: with several engines on two cores, workers pinned
        # to a core (vLLM's default) starve whatever else shares it, and a TP-2 NixlConnector
        # engine was seen to hang so.
        # Insecure serialization: collective_rpc with a function of this module (kvsvc_totals).
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(extra_env or {}))
        # An embedded kvsvc server of this test process points UCX's log at its private
        # directory through the environment; an engine must not inherit that (the directory
        # goes with the server, and UCX in a NixlConnector worker then fails to start).
        for var in ("UCX_LOG_FILE", "UCX_PROTO_INFO", "KVSVC_UCX_LOG_OWNER"):
            env.pop(var, None)
        if connector and connector.get("kv_connector") == "NixlConnector":
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_ports(tp))
        env.update(amx_site(connector))  # a connector other than kvsvc's, on a CPU with AMX
        self.log = logs / f"{name}.log"
        n = 1
        while self.log.exists():  # an engine started again under the same name keeps the first one's log
            n += 1
            self.log = logs / f"{name}.{n}.log"
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine_proc", str(model), json.dumps({"tensor_parallel_size": tp, **(engine_args or {})}),
             json.dumps(connector) if connector else ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file, text=True, cwd=ROOT, env=env,
            start_new_session=True)
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"engine {self.name} did not start:\n{self.tail()}")
        assert json.loads(line) == {"ready": True}

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} died:\n{self.tail()}")
        return json.loads(line)

    def blocks_free(self, timeout_s: float = 60) -> bool:
        """True once the engine holds no KV block (P frees a request's after kvsvc released it)."""
        return bool(self._ask({"op": "blocks_free", "timeout_s": timeout_s})["free"])

    def kvsvc_totals(self) -> dict[str, int]:
        """The kvsvc connector's transfers since start (loaded, failed, cancelled, bytes), all workers."""
        return self._ask({"op": "kvsvc_totals"})["totals"]

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None = None,
                 ignore_eos: bool = False) -> list[dict[str, Any]]:
        """ignore_eos: every request generates max_tokens (or up to the model's length), as a
        test that needs the engine busy for a known number of steps asks."""
        return self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "params": params or [None] * len(prompts), "ignore_eos": ignore_eos})["outputs"]

    def tail(self, n: int = 40) -> str:
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if "Location 'file" not in x]
        return "\n".join(lines[-n:])

    def kill(self) -> None:
        """SIGKILL the whole engine: driver, engine core and workers (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.stop()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(90)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        try:  # nothing of the engine may outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self._log_file):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        return self.proc.returncode


class Engines:
    """Engines started on demand (in parallel when asked together) and stopped at the end."""

    def __init__(self, model: Path, logs: Path, engine_args: dict[str, Any] | None = None) -> None:
        self.model, self.logs, self.engine_args = model, logs, engine_args
        self._cache: dict[str, Engine] = {}

    def get(self, *specs: tuple[str, int, dict[str, Any] | None]) -> list[Engine]:
        """specs: (name, tp, connector config); started ones are reused."""
        new = [Engine(name, self.model, self.logs, tp=tp, connector=conn, engine_args=self.engine_args)
               for name, tp, conn in specs if name not in self._cache]
        for e in new:
            self._cache[e.name] = e
        for e in new:
            e.wait_ready()
        return [self._cache[name] for name, *_ in specs]

    def drop(self, name: str) -> None:
        """Stop the engine; none of its kvsvc servers may still accept connections after."""
        e = self._cache.pop(name, None)
        if e is not None:
            e.stop()
            assert_servers_gone(name, e.log)

    def stop_all(self) -> None:
        for name in list(self._cache):
            self.drop(name)


# Generous lease and peer deadlines: on two cores shared by several engines, a first contact between
# fresh engines has been seen to stall for ~30 s (docs/VLLM.md); the tests check the bytes
# and the lease accounting, not the latency.
PATIENT = {"lease_ttl_s": 150, "peer_timeout_s": 60}


def kvsvc(role: str, **extra: Any) -> dict[str, Any]:
    conf = dict(KVSVC, kv_role=role, kv_connector_extra_config={**PATIENT, **extra})
    if role == "kv_consumer":
        conf["kv_load_failure_policy"] = "recompute"
    return conf


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
