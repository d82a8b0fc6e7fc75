"""OpenTelemetry traces across P and D.

An engine that sends a W3C `traceparent` with Transfer gets the transfer's spans in its
trace: on D `kvsvc.Transfer` with its phases (peer, plan, post, claim, reads, confirm),
and on each P server the claim and notifications it answered, joined by the trace
context D passes with every LeaseChannel call (or in the metadata of a unary one).
Without an SDK tracer provider these are no-ops; `kvsvc serve --otlp-endpoint URL`
installs one that exports over OTLP.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvsvc.reasons import Reason

tracer = trace.get_tracer("kvsvc")


# A W3C traceparent is 55 characters; longer values (and other headers) are not parsed.
MAX_TRACE_HEADER_CHARS = 512


def context_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The trace context a caller sent in its gRPC metadata (empty when it sent none)."""
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate") and isinstance(v, str)
               and len(v) <= MAX_TRACE_HEADER_CHARS}
    return propagate.extract(carrier)


def context_from_traceparent(traceparent: str) -> Context:
    """The context of a LeaseCall's traceparent; one that is absent or oversized is ignored
    (tracing never fails a call)."""
    ok = traceparent and len(traceparent) <= MAX_TRACE_HEADER_CHARS
    return propagate.extract({"traceparent": traceparent} if ok else {})


def traceparent(span: Span) -> str:
    """The W3C traceparent of span, for the calls made on its behalf ("" when not recording)."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


class Clock:
    """perf_counter readings as Unix nanoseconds, for spans recorded after the fact."""

    def __init__(self) -> None:
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def ns(self, perf_s: float) -> int:
        return self._offset_ns + int(perf_s * 1e9)


def record_phases(parent: Span, clock: Clock, started: float, marks: Sequence[tuple[str, float]]) -> None:
    """One child span per phase, from the timestamps the transfer took anyway."""
    if not parent.is_recording():
        return
    ctx = trace.set_span_in_context(parent)
    prev = started
    for name, at in marks:
        tracer.start_span(name, context=ctx, start_time=clock.ns(prev)).end(end_time=clock.ns(at))
        prev = at


def record_span(parent: Span, clock: Clock, name: str, start: float, end: float, **attributes: Any) -> None:
    if parent.is_recording():
        span = tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=clock.ns(start),
                                 attributes=attributes)
        span.end(end_time=clock.ns(end))


def mark_error(span: Span, err: BaseException) -> None:
    reason = getattr(err, "reason", type(err).__name__)
    span.set_attribute("kvsvc.error_reason", reason)
    span.set_status(Status(StatusCode.ERROR, reason))


def server_span(name: str, ctx: Context, **attributes: Any) -> Any:
    """A span for an RPC (or LeaseChannel call) this server answers, under the caller's trace.

    With no SDK installed and no trace context from the caller, the span OpenTelemetry
    would make is the invalid one, recording nothing and passing nothing on: that one is
    given without OpenTelemetry's machinery (~3 % of a D server's CPU per short transfer).
    """
    if not ctx and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name, context=ctx, kind=SpanKind.SERVER, attributes=attributes,
                                        record_exception=False, set_status_on_exception=False)


def install_otlp(endpoint: str, service_name: str) -> None:
    """Export spans over OTLP/gRPC (needs the opentelemetry-exporter-otlp-proto-grpc package)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        from kvsvc.errors import FailedPrecondition

        raise FailedPrecondition(Reason.OTLP_UNAVAILABLE, "otlp_endpoint is set but the OTLP exporter is not installed: "
                                 "pip install 'kvsvc[otlp]' (opentelemetry-exporter-otlp-proto-grpc)") from e
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
