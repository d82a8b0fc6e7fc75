"""The engine integration example runs against live servers and leaves every block free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import layout_table, servers

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples" / "pd_engines.py"


def test_engine_example():
    with servers(2, 1, layout_table(k=4, nb=16)) as (p, d):
        proc = subprocess.run([sys.executable, str(EXAMPLE), "--prefill", p.address, "--decode", d.address,
                               "--requests", "8", "--blocks", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 8 requests of 3 blocks need 24 > 16 blocks: the prefill engine must reuse released ones.
    assert "8 requests moved, KV verified; prefill has 16 of 16 blocks free" in proc.stdout
    assert proc.stdout.count("RELEASE_REASON_CONSUMED") == 8
