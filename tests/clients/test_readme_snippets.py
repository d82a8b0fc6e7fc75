"""docs/USAGE.md's Python, Node.js and config snippets, run as pasted against live servers.

The one edit made to a snippet is the server addresses (the tests' servers listen on free
ports). The grpcurl lines have their own test (test_grpcurl_readme.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import layout_table, servers

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "docs" / "USAGE.md").read_text()
NODE = shutil.which("node")


def snippet(after_heading: str, lang: str) -> str:
    section = README.split(after_heading, 1)[1]
    return section.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def with_addresses(code: str, p: str, d: str) -> str:
    assert "127.0.0.1:50051" in code and "127.0.0.1:50052" in code, code
    return code.replace("127.0.0.1:50051", p).replace("127.0.0.1:50052", d)


PY_LAYOUT = layout_table(k=4, nb=16)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


@pytest.mark.parametrize("inside_a_running_loop", [False, True], ids=["script", "inside-asyncio"])
def test_python_client_snippet(inside_a_running_loop):
    code = snippet("## Python client\n", "python")
    with servers(1, 1, PY_LAYOUT) as (p, d):
        code = with_addresses(code, p.address, d.address)
        if inside_a_running_loop:  # a notebook or an async engine: the sync Client must still work
            code = "import asyncio\n\nasync def main():\n" + "".join(
                f"    {line}\n" for line in code.splitlines()) + "\nasyncio.run(main())\n"
        out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    total, durations = out.stdout.split(maxsplit=1)
    assert int(total) > 0 and durations.startswith("["), out.stdout


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_node_snippet_runs_as_pasted():
    if not (ROOT / "clients/node/node_modules/@grpc/grpc-js").exists():
        pytest.fail("clients/node/node_modules is missing: `make node` (or `make test`) installs it")
    with servers(1, 1, PY_LAYOUT) as (p, d):
        out = run([NODE, "-e", with_addresses(snippet("## Node.js client\n", "js"), p.address, d.address)])
    assert out.returncode == 0, out.stderr
    assert re.search(r"^moved \d+ bytes$", out.stdout, re.M), out.stdout
    assert "FAILED_PRECONDITION LEASE_EXPIRED" in out.stdout, out.stdout


def test_config_example_starts_or_fails_clearly(tmp_path):
    """The [server]/[layout] example as pasted: it asks for VRAM, so a machine without a GPU
    must get one clear line, not a traceback."""
    cfg = tmp_path / "node.toml"
    cfg.write_text(snippet("### Config\n", "toml"))
    kvsvc = str(Path(sys.executable).parent / "kvsvc")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        pytest.skip("this machine has a GPU: the example would allocate its pools")
    out = run([kvsvc, "serve", "--config", str(cfg), "--listen", "127.0.0.1:0"],
              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "CUDA_UNAVAILABLE" in out.stderr and 'memory = "dram"' in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
