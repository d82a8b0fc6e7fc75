"""`kvsvc demo` as a user runs it: a verified transfer, or a clear refusal and a non-zero exit."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsvc.cli.main", "demo", *args], capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("args", [
    (), ("--prefill-tp", "1", "--decode-tp", "2", "--mla", "--layers", "2"),
    ("--mla", "--prefill-tp", "4", "--prefill-dcp", "4", "--decode-tp", "2", "--decode-dcp", "2", "--layers", "2",
     "--blocks", "9", "--decode-servers", "2"),
])
def test_demo_verifies(args):  # the README's own shapes: tests/e2e/test_doc_commands.py
    out = demo(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VERIFIED" in out.stdout
    flags = {a: v for a, v in itertools.pairwise(args) if a.startswith("--")}
    p_servers, d_servers = int(flags.get("--prefill-servers", 1)), int(flags.get("--decode-servers", 1))
    assert out.stdout.count("RELEASE_REASON_CONSUMED") == p_servers  # once per prefill server
    assert "exit codes " + ", ".join(["0"] * (p_servers + d_servers)) + ")" in out.stdout


@pytest.mark.parametrize(("args", "reason"), [
    (("--kv-heads", "6", "--prefill-tp", "3", "--decode-tp", "2"), "TP_NOT_DIVISIBLE"),
    (("--kv-heads", "6", "--prefill-tp", "4"), "INVALID_LAYOUT"),
    (("--prefill-tp", "2", "--prefill-servers", "3"), "INVALID_ARGUMENT"),
    (("--prefill-tp", "2", "--prefill-dcp", "2"), "INVALID_LAYOUT"),  # DCP needs MLA
    (("--mla", "--prefill-tp", "4", "--prefill-dcp", "2"), "INVALID_LAYOUT"),  # DCP is 1 or the TP size
])
def test_demo_refuses_clearly(args, reason):
    out = demo(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(f"kvsvc: {reason}:") and "Traceback" not in out.stderr
