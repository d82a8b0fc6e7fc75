"""Every link between kvsvc's documents resolves: a relative link in README.md, docs/ or
any other markdown file of the repository names a file or directory that exists (its
#anchor, if any, aside), and every path in backticks that looks like a repository file
(`benchmarks/...`, `tests/...`, `docs/...`, `kvsvc/...`) does too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", "node_modules", ".venv", ".venv-vllm", ".venv-sglang", "kvsvc.egg-info", ".pytest_cache"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Written by a run, not kept in the repository (the document says so where it names them).
GENERATED = {"benchmarks/chaos.json"}
PATH = re.compile(r"`((?:bench|benchmarks|tests|docs|kvsvc|deploy|examples|clients|protos)/[A-Za-z0-9_./-]+)`")


def documents() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


def targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text(errors="replace")
    out = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL, or an anchor in the same document
        path = link.split("#", 1)[0]
        out.append((link, (doc.parent / path) if not path.startswith("/") else ROOT / path.lstrip("/")))
    for path in PATH.findall(text):
        if any(ch in path for ch in "*{}<>") or path.endswith("."):
            continue
        path = path.split("::", 1)[0].rstrip("/.,")
        out.append((path, ROOT / path))
    return out


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_in_documents_resolve(doc):
    missing = sorted({name for name, where in targets(doc) if not where.exists() and name not in GENERATED})
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"
