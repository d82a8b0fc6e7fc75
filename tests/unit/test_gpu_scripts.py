"""The scripts prepared for a GPU machine (tests/gpu) at least parse here, where no GPU runs
them: a syntax error must not wait for the next lent device to show. (vllm_pd_one_gpu.py also
runs end to end on CPU with --dry-run: make test-full.)"""

from __future__ import annotations

import py_compile
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"


@pytest.mark.parametrize("script", sorted(GPU.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_compile(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)
