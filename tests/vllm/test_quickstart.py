"""The vLLM quick start as a user pastes it (README, docs/VLLM.md): examples/tiny_model.py writes a
model, examples/vllm_pd.sh starts P, D and the router, sends a request through them and shows
what kvsvc moved. Only the ports differ (free ones, through the script's own variables)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvsvc.integrations.amx import cpu_has_amx
from tests.vllm.engines import ROOT, _free_port

pytestmark = pytest.mark.timeout(900)
SCRIPT = ROOT / "examples" / "vllm_pd.sh"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("quickstart") / "tiny-llama"
    out = subprocess.run([sys.executable, "examples/tiny_model.py", str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return path


def script_env(tmp_path: Path) -> dict[str, str]:
    ports = {"P_PORT": _free_port(), "D_PORT": _free_port(), "ROUTER_PORT": _free_port()}
    return {**os.environ, "PYTHON": sys.executable, "LOG_DIR": str(tmp_path), **{k: str(v) for k, v in ports.items()}}


def processes_of(model: Path) -> list[str]:
    """Command lines of live processes that name the model (engines, their workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(model) in cmd:
                found.append(f"{entry}: {cmd}")
    return found


def gone(model: Path, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def answer_of(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith('{"id"'))
    return json.loads(line)


@pytest.fixture(scope="module")
def once(tiny_model, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The script run once with --once: its output and its LOG_DIR."""
    logs = tmp_path_factory.mktemp("quickstart-logs")
    out = subprocess.run(["bash", str(SCRIPT), str(tiny_model), "--once"], cwd=ROOT, env=script_env(logs),
                         capture_output=True, text=True, timeout=800)
    return out, logs


def test_quickstart_once(once, tiny_model):
    out, _ = once
    assert out.returncode == 0, (out.stdout, out.stderr)
    answer = answer_of(out.stdout)
    assert answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["text"], answer
    moved = re.search(r"^D loaded (\d+) bytes of KV cache from P through kvsvc$", out.stdout, re.M)
    assert moved and int(moved.group(1)) > 0, out.stdout
    assert not gone(tiny_model), "the script left processes behind"


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): vLLM's bf16 "
                    "attention does not use AMX tiles here, and there is no permission to ask for")
def test_quickstart_engines_hold_amx_tile_data_before_their_first_forward(once):
    """On a CPU with AMX the connector asked Linux for AMX tile data in each engine's worker
    and the kernel granted it (checked with ARCH_GET_XCOMP_PERM in that process): D's first
    forward, one recomputed token on vLLM's AMX attention, does not die with SIGILL."""
    out, logs = once
    assert out.returncode == 0, (out.stdout, out.stderr)
    for engine in ("prefill", "decode"):
        log = (logs / f"{engine}.log").read_text(errors="replace")
        assert "kvsvc: AMX tile data" in log and "permitted in this process" in log, f"{engine}.log"


def test_quickstart_serves_until_interrupted(tiny_model, tmp_path):
    env = script_env(tmp_path)
    with subprocess.Popen(["bash", str(SCRIPT), str(tiny_model)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        try:
            interact(proc, env, tiny_model)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not gone(tiny_model), "Ctrl-C left processes behind"


def interact(proc: subprocess.Popen, env: dict[str, str], tiny_model: Path) -> None:
    """Wait for the script to serve, send a request of our own, then press Ctrl-C."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving:"):
            break
    assert lines and lines[-1].startswith("serving:"), "".join(lines)
    # The user's own request, through the router the script left running.
    body = {"model": str(tiny_model), "prompt": "Prefill computes", "max_tokens": 8, "temperature": 0}
    r = requests.post(f"http://127.0.0.1:{env['ROUTER_PORT']}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(120) == 130


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["a", "--twice"]])
def test_quickstart_usage(argv):
    out = subprocess.run(["bash", str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage:" in out.stderr, out
