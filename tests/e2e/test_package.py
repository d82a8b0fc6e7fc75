"""kvsvc as a user installs it: `python -m build` makes a wheel and an sdist with the license,
the version and the extras in their metadata; the wheel, installed into a new venv that has
nothing of this checkout, runs `kvsvc demo` (a real P -> D transfer, verified)."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvsvc

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # From a copy of the tracked files: the build must not depend on what lies untracked here.
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        path = src / name.decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name.decode(), path)
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def test_the_wheel_carries_the_license_version_and_extras(dist):
    wheel = zipfile.ZipFile(next(dist.glob("kvsvc-*.whl")))
    names = wheel.namelist()
    meta = email.message_from_bytes(wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert meta["Version"] == kvsvc.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"server", "vllm", "otlp"} <= set(meta.get_all("Provides-Extra"))
    assert "kvsvc/v1/kv_transfer_pb2.py" in names and "kvsvc/integrations/vllm/connector.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    sdist = tarfile.open(next(dist.glob("kvsvc-*.tar.gz")))
    assert any(n.endswith("/LICENSE") for n in sdist.getnames())


def test_the_wheel_in_a_new_venv_runs_the_demo(dist, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # NIXL depends on torch: the CPU build on a machine without a GPU (as the Makefile picks).
    torch = "torch" if shutil.which("nvidia-smi") else "torch==2.13.0"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for spec in ([torch], [f"{next(dist.glob('kvsvc-*.whl'))}[vllm]"]):
        out = subprocess.run(pip + spec, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    kvsvc_bin = str(venv / "bin" / "kvsvc")
    version = subprocess.run([kvsvc_bin, "--version"], capture_output=True, text=True, timeout=60, env=env,
                             cwd=tmp_path)
    assert version.stdout.split() == ["kvsvc", kvsvc.__version__], version
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import kvsvc; print(kvsvc.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), where  # the installed copy, not this checkout
    demo = subprocess.run([kvsvc_bin, "demo"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "VERIFIED" in demo.stdout
