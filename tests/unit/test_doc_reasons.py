"""What the docs say kvsvc refuses with is what the code refuses with: every error reason a
doc names after "refused", "fails", "answers", "raises" (and their forms) is one of
kvsvc.reasons.Reason or a gRPC status code, and a retired reason is named only where the
doc says it is retired (a doc that still promised one would tell users of a refusal that
never comes)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from kvsvc.reasons import RETIRED, Reason

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
REFUSAL = re.compile(r"(?:refused|refuses|refuse|fails|failed|fail|answers|answered|raises|raise)\s+"
                     r"(?:with\s+|as\s+)?(?:`?[A-Z]+_?[A-Z_]*`?\s+)?`([A-Z][A-Z0-9_]{3,})`")
LIVE = {r.name for r in Reason} - {r.name for r in RETIRED}
CODES = {c.name for c in grpc.StatusCode}


def refusals(text: str) -> list[str]:
    return REFUSAL.findall(text)


def test_the_pattern_finds_refusals_and_would_catch_an_unknown_one():
    assert refusals("a commit after it is refused `LEASE_FINAL`; D fails `PEER_UNAVAILABLE`") == [
        "LEASE_FINAL", "PEER_UNAVAILABLE"]
    assert refusals("refused FAILED_PRECONDITION `NO_SUCH_REASON`") == ["NO_SUCH_REASON"]
    assert "NO_SUCH_REASON" not in LIVE | CODES


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_refusal_a_doc_names_is_one_the_code_has(doc):
    unknown = sorted({r for r in refusals(doc.read_text()) if r not in LIVE | CODES})
    assert not unknown, f"{doc.name} names refusals kvsvc does not make: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_a_retired_reason_is_named_only_as_retired(doc):
    lines = doc.read_text().split("\n")
    for i, line in enumerate(lines):
        for reason in RETIRED:
            if re.search(rf"\b{reason.name}\b", line):
                near = " ".join(lines[max(0, i - 1):i + 2]).lower()
                assert "retired" in near or "no longer" in near, f"{doc.name}:{i + 1} promises {reason.name}: {line}"
