"""docs/ARCHITECTURE.md's layer table holds: every module of kvsvc is placed in exactly one
layer, and imports only from its own layer or those listed above it.

The table is read from the document itself (the second cell of each row: the packages and
modules, in backticks, relative to kvsvc/; `protos/` and `clients/...` live outside it), and
every `import kvsvc...` of every module is looked at, lazy ones in functions and those
under TYPE_CHECKING included: a layer that needs a lower one even for a type is drawn in
the wrong place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvsvc"
OUTSIDE = ("protos/", "clients/")  # in the table, but not under kvsvc/


def layers() -> list[tuple[str, list[str]]]:
    """(layer name, paths under kvsvc/) in the table's order, top first."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = doc.split("| layer | package | what it knows |", 1)[1].split("\n\n", 1)[0]
    out = []
    for row in table.strip().splitlines()[1:]:  # past the |---| line
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        paths = [p for p in re.findall(r"`([^`]+)`", cells[1]) if not p.startswith(OUTSIDE)]
        out.append((cells[0], paths))
    return out


LAYERS = layers()


def layer_of(rel: str) -> int | None:
    """The index of the layer that places kvsvc/<rel> (its most specific entry), or None."""
    best: tuple[int, int] | None = None
    for i, (_, paths) in enumerate(LAYERS):
        for p in paths:
            if rel == p or (p.endswith("/") and rel.startswith(p)):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return best[0] if best else None


def modules() -> list[str]:
    return sorted(str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py") if f.name != "__init__.py"
                  or f.parent != PACKAGE)


def imported(source: Path) -> list[str]:
    """The kvsvc modules a file imports, as paths under kvsvc/."""
    out = []
    for node in ast.walk(ast.parse(source.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvsvc."):
            names = [str(node.module)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("kvsvc.")]
        for name in names:
            path = "/".join(name.split(".")[1:])
            out.append(f"{path}.py" if (PACKAGE / f"{path}.py").exists() else f"{path}/__init__.py")
    return out


def test_the_table_names_only_what_exists():
    for _, paths in LAYERS:
        for p in paths:
            assert (PACKAGE / p).exists(), f"ARCHITECTURE.md places {p}, which is not in kvsvc/"


def test_every_module_is_placed_in_a_layer():
    unplaced = [m for m in modules() if layer_of(m) is None]
    assert not unplaced, f"modules no layer of ARCHITECTURE.md places: {unplaced}"


def violations(rel: str, source: Path) -> list[str]:
    """The imports of source (placed as kvsvc/<rel>) against the layer order."""
    mine = layer_of(rel)
    assert mine is not None
    out = []
    for target in imported(source):
        theirs = layer_of(target)
        if theirs is not None and theirs > mine:
            out.append(f"{rel} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    return out


def test_no_module_imports_from_a_layer_below_its_own():
    wrong = [v for m in modules() for v in violations(m, PACKAGE / m)]
    assert not wrong, "imports against ARCHITECTURE.md's layer order:\n" + "\n".join(wrong)


def test_the_check_catches_a_wrong_import(tmp_path):
    """The checker itself: a pure module importing the service, even lazily, is caught."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from kvsvc.service.node import Node\n    return Node\n")
    assert violations("layout/bad.py", source) == ["layout/bad.py (pure) imports service/node.py (service)"]
