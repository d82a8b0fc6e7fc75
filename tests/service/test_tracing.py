"""One trace across an engine, a D server and a P server (both real, in this process), seen
through an OpenTelemetry in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvsvc.client import AsyncClient
from kvsvc.codec import block_ids_to_proto
from kvsvc.config import MemoryMode, Role, load_config
from kvsvc.errors import PermissionDenied
from kvsvc.service.server import create_server
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.v1 import kv_transfer_pb2_grpc as pb_grpc
from tests.e2e.harness import ClaimsSeen, HeldReads, reads_end_before_post_returns

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> Iterator[None]:
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(tp)  # once per process: the kvsvc tracer follows the global provider
    yield
    tp.shutdown()  # later tests in this process export nothing
    EXPORTER.clear()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[tuple[Any, AsyncClient], tuple[Any, AsyncClient]]]:
    """(P server, its client), (D server, its client): both in this process."""
    layout = {"model_id": "tr", "total_num_kv_heads": 4, "block_size": 16, "num_blocks": 32, "dtype": "bfloat16",
              "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}
    p, p_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="tr-p", tp_size=1,
                                                role=Role.PREFILL, memory=MemoryMode.DRAM, layout_table=layout))
    d, d_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="tr-d", tp_size=1,
                                                role=Role.DECODE, memory=MemoryMode.DRAM, layout_table=layout))
    try:
        async with AsyncClient(f"127.0.0.1:{p_port}") as pc, AsyncClient(f"127.0.0.1:{d_port}") as dc:
            yield (p, pc), (d, dc)
    finally:
        await d.stop(0)
        await p.stop(0, drain_s=0)


async def _traced_transfer(pc: AsyncClient, dc: AsyncClient, request_id: str) -> tuple[dict[str, Any], Any]:
    """One transfer under an engine's root span: the finished spans by name, and the root."""
    pub = await pc.publish_blocks(request_id, [[1, 2]])
    EXPORTER.clear()
    engine = trace.get_tracer("engine")
    with engine.start_as_current_span("engine.request") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        req = pb.TransferRequest(request_id=f"d-{request_id}", params=pub.params,
                                 local_block_ids_per_group=block_ids_to_proto([[5, 6]]))
        await pb_grpc.KvTransferServiceStub(dc.channel).Transfer(req, metadata=tuple(carrier.items()), timeout=30)
    spans = EXPORTER.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}, [s.name for s in spans]
    return {s.name: s for s in spans}, root


def _check_one_trace(by_name: dict[str, Any], root: Any, request_id: str, phases: tuple[str, ...],
                     p_spans: tuple[str, ...]) -> None:
    transfer = by_name["kvsvc.Transfer"]
    assert transfer.parent.span_id == root.get_span_context().span_id
    assert transfer.attributes["kvsvc.request_id"] == f"d-{request_id}"
    assert transfer.attributes["kvsvc.remote_request_id"] == request_id and transfer.attributes["kvsvc.bytes"] > 0
    for phase in phases:
        assert by_name[phase].parent.span_id == transfer.context.span_id, phase
        assert by_name[phase].start_time <= by_name[phase].end_time
    # P's side of the same trace, under D's span.
    for name in p_spans:
        assert by_name[name].parent.span_id == transfer.context.span_id, name
        assert by_name[name].attributes["kvsvc.request_id"] == request_id
        assert by_name[name].attributes["kvsvc.peer_engine"] == "tr-d"


async def test_a_short_transfer_is_one_trace_from_engine_to_p(pair):
    """READs that ended within their post: one claim-and-consumed after them, no claim phase."""
    (_, pc), (d, dc) = pair
    reads_end_before_post_returns(d)
    by_name, root = await _traced_transfer(pc, dc, "p-short")
    # P's side: one claim that says consumed.
    _check_one_trace(by_name, root, "p-short", ("peer", "plan", "post", "reads", "confirm"), ("kvsvc.claim",))
    assert "kvsvc.notify" not in by_name
    assert "claim" not in by_name, "a READ that had ended claimed early"


async def test_a_long_transfer_is_one_trace_with_its_early_claim(pair):
    """A READ still running past EARLY_CLAIM_S (held until P granted the claim, so certain
    on any machine): the claim is a phase of its own, under the same trace."""
    (p, pc), (d, dc) = pair
    reads, claims = HeldReads(d), ClaimsSeen(p)

    async def release_once_claimed() -> None:
        await claims.granted("p-long").wait()
        reads.release()

    releaser = asyncio.ensure_future(release_once_claimed())
    try:
        by_name, root = await _traced_transfer(pc, dc, "p-long")
    finally:
        releaser.cancel()
    assert claims.granted("p-long").is_set()
    # P's side: the claim during the READ, and the CONSUMED that confirmed it.
    _check_one_trace(by_name, root, "p-long", ("peer", "plan", "post", "claim", "reads", "confirm"),
                     ("kvsvc.claim", "kvsvc.notify"))


async def test_a_failed_transfer_says_why_on_its_span(pair):
    (_, pc), (_, dc) = pair
    pub = await pc.publish_blocks("p-bad", [[3]])
    pub.params.lease_token = "not-the-token"
    EXPORTER.clear()
    with pytest.raises(PermissionDenied):
        await dc.transfer("d-bad", pub.params, [[7]])
    transfer = next(s for s in EXPORTER.get_finished_spans() if s.name == "kvsvc.Transfer")
    assert transfer.status.status_code == trace.StatusCode.ERROR
    assert transfer.attributes["kvsvc.error_reason"] == "LEASE_TOKEN_MISMATCH"
    claim = next(s for s in EXPORTER.get_finished_spans() if s.name == "kvsvc.claim")
    assert claim.context.trace_id == transfer.context.trace_id


def test_trace_headers_are_bounded():
    from kvsvc.service.tracing import context_from_metadata, context_from_traceparent

    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace.get_current_span(context_from_traceparent(good)).get_span_context().trace_id == int(
        "0af7651916cd43dd8448eb211c80319c", 16)
    huge = good + "x" * 10_000
    assert not trace.get_current_span(context_from_traceparent(huge)).get_span_context().is_valid
    assert not trace.get_current_span(context_from_metadata([("traceparent", huge)])).get_span_context().is_valid


def test_without_an_sdk_a_span_is_the_invalid_one_unless_the_caller_sent_a_trace() -> None:
    """server_span's short cut (no SDK, no caller trace) gives what OpenTelemetry would, and
    a caller's trace still passes through to P without an SDK. In a fresh process: this
    module installs an SDK provider in its own."""
    import subprocess
    import sys

    code = """
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from kvsvc.service.tracing import server_span, traceparent
with server_span("kvsvc.Transfer", Context()) as span:
    assert span is trace.INVALID_SPAN and not span.get_span_context().is_valid, span
    assert traceparent(span) == ""
tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
with server_span("kvsvc.Transfer", propagate.extract({"traceparent": tp})) as span:
    assert not span.is_recording()
    assert traceparent(span).split("-")[1] == "0af7651916cd43dd8448eb211c80319c", traceparent(span)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
