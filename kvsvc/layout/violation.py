"""One broken compatibility rule between two engines' layouts (compat.py collects them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: an ErrorInfo reason, what to change, and the offending values."""

    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)


def violation(reason: str, message: str, **meta: object) -> Violation:
    return Violation(reason, message, {k: str(v) for k, v in meta.items()})
