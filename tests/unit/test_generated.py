"""The committed stubs match protos/, and the pure layers stay pure."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    proc = subprocess.run([sys.executable, "-m", "kvsvc.protogen", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0] if not node.module.startswith("kvsvc.") else node.module)
    return mods


def test_pure_layers_import_no_grpc_nixl_torch():
    for pkg in ("layout", "mapping"):
        for path in (ROOT / "kvsvc" / pkg).glob("*.py"):
            mods = _imports(path)
            assert not mods & {"grpc", "nixl", "torch", "google"}, (path, mods)
            assert not any(m.startswith(("kvsvc.v1", "kvsvc.service", "kvsvc.transport", "kvsvc.memory"))
                           for m in mods), (path, mods)


def test_client_import_needs_no_torch_or_nixl():
    code = "import sys, kvsvc.client; assert 'torch' not in sys.modules and 'nixl' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
