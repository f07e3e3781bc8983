"""Optional OpenTelemetry tracing across the facade → engine hop (``--otlp-traces-endpoint``).

OpenTelemetry is an optional extra (``pip install 'sluice-llm[otel]'``) and is imported only when
tracing is turned on, so that nothing pays for it otherwise. The facade opens a server span per
HTTP request and sends its W3C ``traceparent`` (and ``tracestate``) in every EngineService call's
gRPC metadata; the engine's servicer opens its span of the RPC (Generate, Tokenize, Embed, ...) as
that span's child. No global tracer provider
is set: each process holds its own ``Tracing`` (a provider and a tracer), which tests build over
an in-memory exporter.

Both sides import this module (it sits beside the stubs and the client, which the facade may
import); it imports nothing of the engine.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

EXTRA_HINT = "tracing needs OpenTelemetry: pip install 'sluice-llm[otel]'"
_CARRIED = ("traceparent", "tracestate")


class Tracing:
    """A tracer over ``provider`` (an ``opentelemetry.sdk.trace.TracerProvider``)."""

    def __init__(self, provider: Any, scope: str) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer(scope)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_otlp(cls, endpoint: str, service: str, scope: str) -> Tracing:
        """Spans exported in batches over OTLP/HTTP to ``endpoint`` (e.g. http://collector:4318/v1/traces).
        Raises ``RuntimeError`` naming the extra when OpenTelemetry is not installed."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError(f"--otlp-traces-endpoint: {EXTRA_HINT} ({exc.name} is missing)") from None
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider, scope)

    @contextlib.contextmanager
    def server_span(self, name: str, metadata: Sequence[tuple[str, Any]] | None = None,
                    attributes: dict[str, Any] | None = None) -> Iterator[Any]:
        """A SERVER span, the child of the ``traceparent`` in ``metadata`` when there is one,
        current while the block runs."""
        from opentelemetry.trace import SpanKind

        carrier = {k: v for k, v in (metadata or ()) if k in _CARRIED and isinstance(v, str)}
        parent = self._propagator.extract(carrier) if carrier else None
        with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                               attributes=attributes or {}) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current span's ``traceparent`` as gRPC metadata, or None when nothing is traced (also
    when OpenTelemetry was never imported: then no span can be current)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return tuple(carrier.items()) or None
