"""OpenTelemetry tracing: off unless the standard ``OTEL_*`` variables ask for it.

On when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, or
``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keep it off (:func:`shared.otel_env.tracing_enabled`, which needs
no OpenTelemetry). This module is imported only with tracing on, first by
:func:`shared.config.load_tracing`: the API's own dependencies do not include OpenTelemetry.
Everything else is the SDK's own reading of the environment: the endpoint, headers, timeout and
compression (the OTLP exporter), the service name and resource attributes (``Resource.create``),
the sampler (``OTEL_TRACES_SAMPLER``, parent-based by default: a client's unsampled
``traceparent`` stays unsampled) and the batch processor's delays.

Each entrypoint builds one :class:`Tracing` (or None) and passes it down; with None nothing on the
hot path does tracing work, and no OpenTelemetry module is imported.

One request is one trace across processes: the API's span of the HTTP request (api/tracing.py)
is the parent of the worker's spans (workers/tracing.py), through the W3C ``traceparent`` stored
in the job record. docs/operations.md#tracing shows the tree.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, format_span_id, format_trace_id, set_tracer_provider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.otel_env import otlp_protocol, traces_exporter

__all__ = ["Tracing", "parent_context", "traceparent_of", "trace_id_of",
           "TRACEPARENT", "MODEL", "TENANT", "JOB_ID", "DIALECT", "INPUT_TOKENS", "OUTPUT_TOKENS",
           "FINISH_REASONS", "TOOL_CALLS", "ERROR_TYPE"]

TRACEPARENT = "traceparent"

# Attribute names: OpenTelemetry's GenAI conventions where one exists, llmq.* for the rest.
MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
ERROR_TYPE = "error.type"
TOOL_CALLS = "llmq.tool_calls"
JOB_ID = "llmq.job_id"
DIALECT = "llmq.dialect"
TENANT = "llmq.tenant"

_propagator = TraceContextTextMapPropagator()


def _exporter(environ: Mapping[str, str]) -> SpanExporter:
    name = traces_exporter(environ) or "otlp"
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: llmq exports traces with otlp or console")
    protocol = otlp_protocol(environ)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    raise ValueError(f"OTLP protocol {protocol!r}: llmq exports traces over http/protobuf or grpc")


class Tracing:
    """The process's tracer; owned by its entrypoint, which calls :meth:`shutdown` last."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("llmq")

    @classmethod
    def from_env(cls, default_service: str, process: str, environ: Mapping[str, str]) -> Tracing:
        """As the OTEL_* variables say (:func:`shared.otel_env.tracing_enabled` decides whether at
        all). ``default_service``: the service name unless ``OTEL_SERVICE_NAME`` (or
        ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``) names one."""
        attributes = {"llmq.process": process}
        if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            attributes["service.name"] = default_service
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(_exporter(environ)))
        return cls(provider)

    def make_global(self) -> None:
        """The worker's: vLLM's spans go through the global provider, so they leave with ours."""
        set_tracer_provider(self.provider)

    def shutdown(self) -> None:
        """Export what is still buffered (the batch processor's last batch) and stop."""
        self.provider.shutdown()


def parent_context(traceparent: str | None) -> Context | None:
    """The remote parent a W3C ``traceparent`` names; None (a new trace) when there is none or it
    is malformed (the W3C rule: an invalid header is ignored, never an error)."""
    if not traceparent:
        return None
    context = _propagator.extract({TRACEPARENT: traceparent})
    return context or None


def traceparent_of(span: Span) -> str:
    """``span``'s W3C ``traceparent``: what the job record stores and vLLM's ``trace_headers`` get."""
    sc = span.get_span_context()
    return f"00-{format_trace_id(sc.trace_id)}-{format_span_id(sc.span_id)}-{int(sc.trace_flags):02x}"


def trace_id_of(span: Span) -> str:
    return format_trace_id(span.get_span_context().trace_id)
