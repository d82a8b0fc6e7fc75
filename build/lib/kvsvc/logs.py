"""Log lines that name their request: a context variable the service sets while it works on
one (the D-side id of a Transfer, the P-side id of a claim or notification), and the
formats `kvsvc serve` writes (text, or one JSON object a line with --log-format json)."""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvsvc_request_id", default="")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds request_id (the request being worked on, "-" when none) and trace_id to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        record.trace_id = _trace_id()
        return True


try:
    from opentelemetry import trace
except ImportError:  # a client-only install logs without traces
    trace = None  # type: ignore[assignment]


def _trace_id() -> str:
    if trace is None:
        return ""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage(), "request_id": getattr(record, "request_id", "-")}
        if getattr(record, "trace_id", ""):
            out["trace_id"] = record.trace_id  # type: ignore[attr-defined]
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def json_lines() -> bool:
    """Whether this process logs JSON lines (setup(fmt="json")): what it prints for
    programs to read is JSON too."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def as_json_line(logger: str, message: str, **fields: Any) -> str:
    """A line shaped as JsonFormatter's records (INFO), with fields of its own: for what a
    command prints on stdout when its logs are JSON, so one reader takes both."""
    record = logging.LogRecord(logger, logging.INFO, "", 0, message, None, None)
    return json.dumps({**json.loads(JsonFormatter().format(record)), **fields})


def setup(level: int, fmt: str = "text") -> None:
    """The root logger of a kvsvc command: stderr, with request ids, as text or JSON."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
