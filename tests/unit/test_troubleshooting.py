"""docs/TROUBLESHOOTING.md quotes what kvsvc says: every reason it names is one kvsvc raises,
and every message it quotes ("You see: `...`", with ... where values go) is one kvsvc (or
the quick start script) prints."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "TROUBLESHOOTING.md").read_text()


def sources() -> str:
    """kvsvc's source with adjacent string literals joined and f-string fields as '...'."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "kvsvc").rglob("*.py")))
    text += (ROOT / "examples" / "vllm_pd.sh").read_text()
    text = re.sub(r"[\"']\s*\n\s*[rfb]*[\"']", "", text)  # "abc "\n  f"def" -> "abc def"
    text = re.sub(r"\{[^{}]*\}", "...", text)  # f-string fields
    text = re.sub(r"\{[^{}]*\}", "...", text)  # ...and those that held a nested one
    return text.replace("!r", "")


def test_every_reason_on_the_page_is_one_kvsvc_raises():
    reasons = {r for heading in re.findall(r"^### (.+)$", PAGE, re.M) for r in re.findall(r"`([A-Z][A-Z_]+)`", heading)}
    assert len(reasons) >= 12, reasons
    code = "\n".join(p.read_text() for p in (ROOT / "kvsvc").rglob("*.py"))
    missing = sorted(r for r in reasons if f'"{r}"' not in code)
    assert not missing, missing


def test_every_quoted_message_is_one_kvsvc_prints():
    src = sources()
    quotes = [q for line in re.findall(r"^You see: (.+)$", PAGE, re.M) for q in re.findall(r"`([^`]+)`", line)]
    assert len(quotes) >= 14, quotes
    for quote in quotes:
        for piece in (p.strip(" ,.") for p in quote.split("...")):
            if len(piece) >= 6:
                assert piece in src, f"{piece!r} (quoted as {quote!r}) is not in kvsvc's messages"


def test_the_checker_would_catch_a_stale_quote():
    src = sources()
    assert "cannot back a ...-byte pool in /dev/shm: " in src  # a real one, joined across its literals
    assert "cannot back a ...-byte pool in /dev/zero" not in src
