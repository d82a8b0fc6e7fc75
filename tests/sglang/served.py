"""SGLang servers and its router as a user runs them, on a machine without a GPU.

Each is a process group of its own (tests.vllm.served.Served). On CPU SGLang needs what
SGLANG.md lists: SGLANG_USE_CPU_ENGINE=1 with the sgl_kernel stand-in and the plugin of
tests/sglang/cpu_fixtures on PYTHONPATH, `--device cpu`, a KV pool of bounded size, the decode
side's retraction backup in a CPU tensor, no early send of cached prefixes, and the
loopback address advertised. None of it is needed, or set, on a GPU.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import requests

from tests.vllm.engines import ROOT, _free_port
from tests.vllm.served import Served

FIXTURES = Path(__file__).resolve().parent / "cpu_fixtures"
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",
    "PYTHONPATH": f"{FIXTURES}:{ROOT}",
}


def sglang_server(name: str, model: Path, logs: Path, *, mode: str | None = None, backend: str = "nixl",
                  tp: int = 1, extra_args: tuple[str, ...] = (),
                  env: dict[str, str] | None = None) -> tuple[Served, int | None]:
    """A server (aggregated, or prefill/decode with `mode`); for prefill also its bootstrap port."""
    port = _free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-total-tokens", "8192", "--tp-size", str(tp),
            "--random-seed", "0", *extra_args]
    bootstrap = None
    if mode:
        argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
    if mode == "prefill":
        bootstrap = _free_port()
        argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
    if mode == "decode":
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    env = {**CPU_ENV, **(env or {})}
    if tp > 1:  # on CPU each rank is bound to cores of its own: one core each here
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    return Served(name, argv, logs, port, env), bootstrap


# The router registers its workers after they are up (it asks each for its connection mode
# and loads the tokenizer); on two busy cores that once took over a minute.
ROUTER_READY_S = 180


def sglang_router(logs: Path, prefill: Served, bootstrap: int, decode: Served, name: str = "sglang-router",
                  extra_args: tuple[str, ...] = ()) -> Served:
    port = _free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill.url,
            str(bootstrap), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
            # Its metrics port is fixed (29000) unless given: one of its own, so routers never clash.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()), *extra_args]
    return Served(name, argv, logs, port, CPU_ENV)


def generate(server: Served, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    """POST /generate; a router still registering its workers answers 503 for a while, so that
    is retried (only that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.post(server.url + "/generate", json=body, timeout=timeout_s)
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, (server.name, r.status_code, r.text[:2000])
    return r.json()


def greedy(text: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_logprob": True}


KVSVC_LINE = re.compile(r"kvsvc: SGLang (prefill|decode) rank (\d+) serves its KV at (\S+)"
                        r"(?: \(metrics at (\S+)\))?")


def kvsvc_servers(server: Served) -> dict[int, tuple[str, str]]:
    """The kvsvc servers an SGLang server embeds (backend kvsvc), from its log: rank ->
    (gRPC address, metrics URL or "")."""
    found = {}
    for m in KVSVC_LINE.finditer(server.log.read_text(errors="replace")):
        found[int(m.group(2))] = (m.group(3), m.group(4) or "")
    return found


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a kvsvc server's Prometheus metrics (0 when it has no such series)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
