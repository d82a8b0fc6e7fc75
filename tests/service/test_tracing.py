"""One trace across an engine, a D server and a P server (both real, in this process), seen
through an OpenTelemetry in-memory exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

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
async def pair() -> AsyncIterator[tuple[AsyncClient, AsyncClient]]:
    layout = {"model_id": "tr", "total_num_kv_heads": 4, "block_size": 16, "num_blocks": 32, "dtype": "bfloat16",
              "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}
    p, p_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="tr-p", tp_size=1,
                                                role=Role.PREFILL, memory=MemoryMode.DRAM, layout_table=layout))
    d, d_port = await create_server(load_config(listen="127.0.0.1:0", engine_id="tr-d", tp_size=1,
                                                role=Role.DECODE, memory=MemoryMode.DRAM, layout_table=layout))
    try:
        async with AsyncClient(f"127.0.0.1:{p_port}") as pc, AsyncClient(f"127.0.0.1:{d_port}") as dc:
            yield pc, dc
    finally:
        await d.stop(0)
        await p.stop(0, drain_s=0)


async def test_a_transfer_is_one_trace_from_engine_to_p(pair):
    pc, dc = pair
    pub = await pc.publish_blocks("p-req", [[1, 2]])
    EXPORTER.clear()
    engine = trace.get_tracer("engine")
    with engine.start_as_current_span("engine.request") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        req = pb.TransferRequest(request_id="d-req", params=pub.params, local_block_ids_per_group=block_ids_to_proto(
            [[5, 6]]))
        await pb_grpc.KvTransferServiceStub(dc.channel).Transfer(req, metadata=tuple(carrier.items()), timeout=30)
    spans = EXPORTER.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}, [s.name for s in spans]
    by_name = {s.name: s for s in spans}
    transfer = by_name["kvsvc.Transfer"]
    assert transfer.parent.span_id == root.get_span_context().span_id
    assert transfer.attributes["kvsvc.request_id"] == "d-req"
    assert transfer.attributes["kvsvc.remote_request_id"] == "p-req" and transfer.attributes["kvsvc.bytes"] > 0
    for phase in ("peer", "plan", "post", "claim", "reads", "confirm"):
        assert by_name[phase].parent.span_id == transfer.context.span_id, phase
        assert by_name[phase].start_time <= by_name[phase].end_time
    # P's side of the same trace: the claim and the CONSUMED it answered, under D's span.
    for name in ("kvsvc.claim", "kvsvc.notify"):
        assert by_name[name].parent.span_id == transfer.context.span_id, name
        assert by_name[name].attributes["kvsvc.request_id"] == "p-req"
        assert by_name[name].attributes["kvsvc.peer_engine"] == "tr-d"


async def test_a_failed_transfer_says_why_on_its_span(pair):
    pc, dc = pair
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
