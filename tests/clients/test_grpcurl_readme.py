"""Every grpcurl line of docs/USAGE.md, run as pasted (from the repository root, venv not
activated) with the real grpcurl binary against a live `kvsvc serve`."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.config import DEFAULT_LAYOUT

ROOT = Path(__file__).resolve().parents[2]
PASTED = ".venv/bin/grpcurl "


def readme_commands() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "USAGE.md").read_text()
    block = text.split("<!-- grpcurl:begin -->")[1].split("<!-- grpcurl:end -->")[0]
    out = []
    for line in block.splitlines():
        if line.startswith(PASTED):
            cmd, expect = line.split("  # -> ")
            out.append((cmd, expect))
    return out


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def server():
    # What `kvsvc serve` does with no arguments, on a free port instead of 50051.
    sp = start_server(engine_id="kvsvc-engine", role="both", tp_size=1, layout=DEFAULT_LAYOUT)
    yield sp
    assert sp.stop() == 0


def test_readme_has_the_workflows():
    rpcs = " ".join(cmd for cmd, _ in COMMANDS)
    for part in (" list", "describe", "/GetInfo", "/PlanTransfer", "/Notify", "/PublishBlocks", "Health/Check"):
        assert part in rpcs


@pytest.mark.parametrize(("cmd", "expect"), COMMANDS, ids=[f"{i}" for i in range(len(COMMANDS))])
def test_readme_command(server, cmd, expect):
    if not (ROOT / PASTED.strip()).exists():
        pytest.fail(f"{PASTED.strip()} is missing: `make test` installs grpcurl into the venv")
    argv = shlex.split(cmd.replace("localhost:50051", server.address))  # the one edit: the test server's port
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert expect in proc.stdout + proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    if "-format-error" not in cmd:
        assert proc.returncode == 0, proc.stderr
