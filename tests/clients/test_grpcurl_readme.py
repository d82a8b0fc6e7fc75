"""Every grpcurl line of the README, run with the real grpcurl binary against a live `kvsvc serve`."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.config import DEFAULT_LAYOUT

ROOT = Path(__file__).resolve().parents[2]
GRPCURL = Path(sys.executable).parent / "grpcurl"


def readme_commands() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- grpcurl:begin -->")[1].split("<!-- grpcurl:end -->")[0]
    out = []
    for line in block.splitlines():
        if line.startswith("grpcurl "):
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
    argv = shlex.split(cmd.replace("localhost:50051", server.address))
    argv[0] = str(GRPCURL)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert expect in proc.stdout + proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    if "-format-error" not in cmd:
        assert proc.returncode == 0, proc.stderr
