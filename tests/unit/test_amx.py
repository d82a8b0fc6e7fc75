"""kvsvc.integrations.amx: AMX tile data asked for where the CPU has AMX, nothing elsewhere.

Each case that asks the kernel runs in a fresh interpreter: the permission is the
process's, and pytest's own process may hold it already (oneDNN asks for it in torch's
bf16 GEMMs). Which branch the real CPU takes depends on the machine: the other one is
skipped with the reason, and the fake-cpuinfo cases run everywhere.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.integrations import amx

HAS_AMX = amx.cpu_has_amx()
X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def in_fresh_process(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", "import json\nfrom kvsvc.integrations import amx\n" + code],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    return str(path)


def test_the_amx_flag_is_read_from_cpuinfo(tmp_path):
    assert amx.cpu_has_amx(cpuinfo(tmp_path, "fpu sse2 avx512f amx_bf16 amx_tile amx_int8"))
    assert not amx.cpu_has_amx(cpuinfo(tmp_path, "fpu sse2 avx512f avx512_bf16"))
    assert not amx.cpu_has_amx(cpuinfo(tmp_path, "fpu amx_tilex"))  # a whole flag, not a prefix
    assert not amx.cpu_has_amx(str(tmp_path / "missing"))


def test_a_cpu_without_amx_is_left_alone(tmp_path):
    """No AMX in cpuinfo: nothing is asked (the permission stays as it was)."""
    out = in_fresh_process(f"before = amx.amx_permitted()\nr = amx.request_amx({cpuinfo(tmp_path, 'fpu sse2')!r})\n"
                           "print(json.dumps({'r': r.name, 'before': before, 'after': amx.amx_permitted()}))")
    assert out["r"] == "NOT_APPLICABLE"
    assert out["after"] == out["before"]


@pytest.mark.skipif(not X86_LINUX or HAS_AMX, reason="this CPU has AMX (or is not x86-64 Linux): the kernel grants it")
def test_a_refusal_is_reported_not_raised(tmp_path):
    """cpuinfo claims AMX on a CPU without it: the kernel refuses, and request_amx says so
    (and logs why) instead of raising in the engine's worker."""
    out = in_fresh_process(f"r = amx.request_amx({cpuinfo(tmp_path, 'fpu amx_tile')!r})\n"
                           "print(json.dumps({'r': r.name, 'after': amx.amx_permitted()}))")
    assert out == {"r": "REFUSED", "after": False}


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing to ask for")
def test_on_a_cpu_with_amx_the_process_holds_tile_data_once_asked():
    out = in_fresh_process("before = amx.amx_permitted()\nr = amx.request_amx()\nagain = amx.request_amx()\n"
                           "print(json.dumps({'before': before, 'r': r.name, 'again': again.name, "
                           "'after': amx.amx_permitted()}))")
    assert out["before"] is False, "a fresh interpreter held AMX before asking"
    assert out == {"before": False, "r": "HELD", "again": "HELD", "after": True}


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX: the other branch runs")
def test_on_a_cpu_without_amx_nothing_is_asked():
    out = in_fresh_process("r = amx.request_amx()\nprint(json.dumps({'r': r.name, 'after': amx.amx_permitted()}))")
    assert out["r"] == "NOT_APPLICABLE"
    assert out["after"] in (False, None)  # None: a kernel without ARCH_GET_XCOMP_PERM
