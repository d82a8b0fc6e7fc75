"""The committed stubs match protos/, and the pure layers stay pure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    proc = subprocess.run([sys.executable, "-m", "kvsvc.protogen", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


IMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+import|import\s+(\S+))", re.MULTILINE)


def _imports(path: Path) -> set[str]:
    """Top-level modules (kvsvc.* in full) a file imports, at any indentation (lazy imports too).

    A text scan: CPython 3.11.7's ast.parse can fail spuriously after deep recursion elsewhere.
    """
    mods: set[str] = set()
    for m in IMPORT.finditer(path.read_text()):
        name = (m.group(1) or m.group(2)).rstrip(",")
        mods.add(name if name.startswith("kvsvc.") else name.split(".")[0])
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


def test_readme_config_loads(tmp_path):
    from kvsvc.config import MemoryMode, Role, load_config

    text = (ROOT / "docs" / "USAGE.md").read_text()
    toml = text.split("### Config")[1].split("```toml")[1].split("```")[0]
    path = tmp_path / "node.toml"
    path.write_text(toml)
    cfg = load_config(path)
    assert (cfg.engine_id, cfg.role, cfg.tp_size, cfg.memory) == ("prefill-0", Role.PREFILL, 8, MemoryMode.VRAM)
    assert cfg.layout().groups[0].spec.num_kv_heads == 1  # K = 8 over TP 8


MAX_SERVICE_FUNCTION_LINES = 60
_LONG_FUNCTIONS = """
import ast, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > int(sys.argv[2]):
                print(f"{path.name}:{node.lineno} {node.name} {lines}")
"""


def test_no_function_in_the_service_layer_is_longer_than_a_screen():
    """The service layer reads in screens: a longer function wants phases of its own (as
    Decoder's transfer became TransferRun). Parsed in a child (see _imports)."""
    proc = subprocess.run([sys.executable, "-c", _LONG_FUNCTIONS, str(ROOT / "kvsvc" / "service"),
                           str(MAX_SERVICE_FUNCTION_LINES)], capture_output=True, text=True, check=True)
    assert proc.stdout == "", f"functions over {MAX_SERVICE_FUNCTION_LINES} lines:\n{proc.stdout}"
