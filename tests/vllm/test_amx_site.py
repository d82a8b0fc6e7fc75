"""The AMX site a NixlConnector engine starts with on a CPU with AMX (tests/vllm/amx_site).

kvsvc's connector asks for AMX tile data in each worker; vLLM's NixlConnector does not, and
its decode worker died with SIGILL at its first, one-token forward (the GPU script's CPU dry
run). The engines the tests and benchmarks start with another connector carry the site on
their PYTHONPATH: every Python process of theirs then holds the permission from its start.
Which branch runs depends on the CPU; the other is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvsvc.integrations.amx import cpu_has_amx
from tests.vllm.engines import AMX_SITE, KVSVC, NIXL, ROOT, amx_site

HOLDS = "import json\nfrom kvsvc.integrations.amx import amx_permitted\nprint(json.dumps(amx_permitted()))"


def fresh_process_holds_amx(env: dict[str, str]) -> bool | None:
    out = subprocess.run([sys.executable, "-c", HOLDS], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kvsvc_engines_and_engines_without_a_connector_start_as_they_are():
    assert amx_site(None) == {}
    assert amx_site(KVSVC) == {}  # its connector asks in each worker (test_quickstart checks the log)


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing to ask for")
def test_on_a_cpu_with_amx_another_connectors_processes_hold_tile_data_from_their_start():
    env = amx_site(NIXL)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(AMX_SITE)
    assert fresh_process_holds_amx({}) is False  # a process that never asked (no torch, no oneDNN)
    assert fresh_process_holds_amx(env) is True


@pytest.mark.skipif(cpu_has_amx(), reason="this CPU has AMX: the other branch runs")
def test_on_a_cpu_without_amx_no_site_is_added():
    assert amx_site(NIXL) == {}
