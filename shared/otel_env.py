"""The standard ``OTEL_*`` variables, read without OpenTelemetry.

OpenTelemetry is an optional extra (``llmq[tracing]``), so whether tracing is on, and in what
protocol traces go out, must be answerable where it is not installed. This module imports nothing
of it, nor anything of llmq's: shared/tracing.py (which needs OpenTelemetry) reads the variables
through it, shared/config.py's ``load_tracing`` imports shared/tracing.py only once
:func:`tracing_enabled` says tracing is on, and workers/environment.py names the protocol for
vLLM's exporters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["tracing_enabled", "traces_exporter", "otlp_protocol"]


def tracing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the standard OpenTelemetry variables turn tracing on: an OTLP endpoint, or
    ``OTEL_TRACES_EXPORTER`` naming an exporter; ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none`` keep it off. Off by default."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if exporter := traces_exporter(env):
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def traces_exporter(environ: Mapping[str, str]) -> str:
    """``OTEL_TRACES_EXPORTER``, normalised ("" when unset)."""
    return environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()


def otlp_protocol(environ: Mapping[str, str]) -> str:
    """The OTLP protocol the traces go out in: http/protobuf (the SDKs' default) or grpc."""
    return (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf")
