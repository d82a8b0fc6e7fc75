"""The real buf binary: kvsvc.v1 lints clean (STANDARD + COMMENTS), and `buf breaking` against
the committed baseline passes today and catches a break (a field removed) when there is one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"


def buf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_api_lints_clean_and_breaks_nothing():
    protos = ROOT / "protos"
    lint = buf("lint", cwd=protos)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = buf("breaking", "--against", "kvsvc.v1.binpb", cwd=protos)
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_a_removed_field_is_caught(tmp_path):
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    proto = tmp_path / "protos" / "kvsvc" / "v1" / "kv_transfer.proto"
    text = proto.read_text()
    field = "  uint32 populate_ms = 10;\n"
    assert field in text
    proto.write_text(text.replace(field, ""))
    out = buf("breaking", "--against", "kvsvc.v1.binpb", cwd=tmp_path / "protos")
    assert out.returncode != 0 and "populate_ms" in out.stdout + out.stderr, out.stdout + out.stderr
