"""Trace context crosses gRPC: a client span's trace continues in the server's span (via metadata)."""

import asyncio

import grpc
import pytest
from opentelemetry import trace

from services import rpc, telemetry
from services.wire import pb, pb_grpc


class EchoDrafter(pb_grpc.DrafterServicer):
    """Stand-in servicer that only opens a server span per call."""

    def __init__(self):
        self.tracer = telemetry.get_tracer("test.server")

    async def Info(self, request, context):
        with telemetry.server_span(self.tracer, "drafter.info", context):
            return pb.DrafterInfo(block_size=16)

    async def Draft(self, request_iterator, context):
        with telemetry.server_span(self.tracer, "drafter.draft", context):
            async for req in request_iterator:
                yield pb.DraftResponse(positions=req.start)


async def _roundtrip(address):
    running = await rpc.start_server([(pb_grpc.add_DrafterServicer_to_server, EchoDrafter())], address,
                                     [rpc.SERVICE_DRAFTER])
    tracer = telemetry.get_tracer("test.client")
    try:
        async with rpc.open_channel(address, interceptors=telemetry.client_interceptors()) as ch:
            stub = pb_grpc.DrafterStub(ch)
            with tracer.start_as_current_span("client.info") as info_span:
                await stub.Info(pb.InfoRequest())
            with tracer.start_as_current_span("client.draft") as draft_span:
                call = stub.Draft()
                await call.write(pb.DraftRequest(start=3))
                assert (await call.read()).positions == 3
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            # no trace context sent: the server span starts a trace of its own
            await stub.Info(pb.InfoRequest())
    finally:
        await running.stop(0)
    return info_span, draft_span


def test_client_span_continues_in_server(tmp_path):
    provider = telemetry.configure_tracing("memory", "test")
    mem = provider.memory_exporter
    info_span, draft_span = asyncio.run(_roundtrip(f"unix://{tmp_path}/t.sock"))
    spans = {s.name: s for s in mem.get_finished_spans()}
    server_info = [s for s in mem.get_finished_spans() if s.name == "drafter.info"]
    assert len(server_info) == 2
    linked, orphan = sorted(server_info, key=lambda s: s.parent is None)
    assert linked.context.trace_id == info_span.get_span_context().trace_id
    assert linked.parent.span_id == info_span.get_span_context().span_id
    assert linked.parent.is_remote and linked.kind == trace.SpanKind.SERVER
    assert orphan.parent is None and orphan.context.trace_id != linked.context.trace_id
    srv_draft = spans["drafter.draft"]
    assert srv_draft.context.trace_id == draft_span.get_span_context().trace_id
    assert srv_draft.parent.span_id == draft_span.get_span_context().span_id


def test_metadata_roundtrip_and_reconfigure():
    telemetry.configure_tracing("memory", "a")
    tracer = telemetry.get_tracer("t")            # made before the next configure: must follow it
    provider = telemetry.configure_tracing("memory", "b")
    with tracer.start_as_current_span("outer") as span:
        meta = telemetry.inject_metadata([("x-other", "1")])
    assert ("x-other", "1") in meta and any(k == "traceparent" for k, _ in meta)
    ctx = telemetry.context_from_metadata(meta)
    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
    assert [s.name for s in provider.memory_exporter.get_finished_spans()] == ["outer"]
    assert telemetry.context_from_metadata(None) is not None


def test_unknown_exporter_is_a_clear_error():
    with pytest.raises(ValueError, match="console"):
        telemetry.configure_tracing("jaeger", "x")
