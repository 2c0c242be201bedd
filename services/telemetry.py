"""OpenTelemetry for the services: tracer set-up (none / console / otlp / memory) and W3C trace-context
propagation over gRPC metadata (client interceptors inject `traceparent`, servers extract it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("none", "console", "otlp", "memory")

# W3C trace context only (traceparent / tracestate), whatever OTEL_PROPAGATORS says: it is the format
# every hop of ours speaks, and gRPC metadata keys are lower-case as W3C's are.
_PROPAGATOR = TraceContextTextMapPropagator()

_lock = threading.Lock()
_provider: TracerProvider | None = None
_global_set = False


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError("--trace otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp "
                               "(or choose --trace console / none)") from None
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def configure_tracing(exporter: str = "none", service_name: str = "specsplit",
                      endpoint: str | None = None) -> TracerProvider:
    """Make a TracerProvider exporting to `exporter` and make it the one get_tracer() uses.

    none: spans are created (trace context still propagates) but go nowhere. console: printed to stdout
    as they end. otlp: batched to `endpoint` (or the OTEL_EXPORTER_OTLP_* environment). memory: kept in an
    InMemorySpanExporter, reachable as `provider.memory_exporter` (tests).
    The first call also installs the provider as OpenTelemetry's global one (the API allows that once);
    later calls (tests) replace what get_tracer() hands out, including tracers made earlier.
    """
    global _provider, _global_set
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.memory_exporter = None     # type: ignore[attr-defined]
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
    elif exporter == "memory":
        mem = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(mem))
        provider.memory_exporter = mem  # type: ignore[attr-defined]
    with _lock:
        old, _provider = _provider, provider
        if not _global_set:
            trace.set_tracer_provider(provider)
            _global_set = True
    if old is not None and old is not trace.get_tracer_provider():
        old.shutdown()
    return provider


def current_provider() -> trace.TracerProvider:
    return _provider if _provider is not None else trace.get_tracer_provider()


class _Tracer(trace.Tracer):
    """Resolves the provider at each span, so module-level tracers follow a later configure_tracing()."""

    def __init__(self, name: str):
        self._name = name

    def _real(self) -> trace.Tracer:
        return current_provider().get_tracer(self._name)

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._real().start_span(*args, **kwargs)

    @contextlib.contextmanager
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[trace.Span]:
        with self._real().start_as_current_span(*args, **kwargs) as span:
            yield span


def get_tracer(name: str) -> trace.Tracer:
    """A tracer that always uses the provider of the latest configure_tracing() (no-op before any)."""
    return _Tracer(name)


# ---------------------------------------------------------------------------------------------------
# propagation


def inject_metadata(metadata: Sequence[tuple[str, str | bytes]] | None = None,
                    context: otel_context.Context | None = None) -> list[tuple[str, str | bytes]]:
    """`metadata` plus traceparent / tracestate for `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    out = [(k, v) for k, v in (metadata or ()) if k not in carrier]
    out.extend(carrier.items())
    return out


class _MetadataGetter(Getter[Mapping[str, list[str]]]):
    def get(self, carrier: Mapping[str, list[str]], key: str) -> list[str] | None:
        return carrier.get(key.lower())

    def keys(self, carrier: Mapping[str, list[str]]) -> list[str]:
        return list(carrier)


def context_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The trace context a caller sent in gRPC metadata (an empty context when it sent none)."""
    carrier: dict[str, list[str]] = {}
    for k, v in metadata or ():
        if isinstance(v, bytes):        # "-bin" keys carry bytes; trace context never does
            continue
        carrier.setdefault(k.lower(), []).append(v)
    return _PROPAGATOR.extract(carrier, getter=_MetadataGetter())


def extract_context(servicer_context: Any) -> otel_context.Context:
    """The caller's trace context from a (grpc or grpc.aio) servicer context's invocation metadata."""
    return context_from_metadata(servicer_context.invocation_metadata())


@contextlib.contextmanager
def server_span(tracer: trace.Tracer, name: str, servicer_context: Any,
                attributes: Mapping[str, Any] | None = None) -> Iterator[trace.Span]:
    """A SERVER span, child of the caller's span, current for the body. Marks the span as an error if the
    body raises (grpc.aio's context.abort raises too: its status is recorded)."""
    parent = extract_context(servicer_context)
    with tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                      attributes=dict(attributes or {})) as span:
        yield span


def _with_trace(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    meta = inject_metadata(list(details.metadata or ()))
    return details._replace(metadata=grpc.aio.Metadata(*meta))


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors that send the current trace context with every call
    (pass to services.rpc.open_channel(..., interceptors=...))."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
