"""An OTLP/HTTP trace receiver on loopback for tests: what the processes under test export with
``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at ``Receiver.url`` (tests/e2e/test_tracing.py).

It decodes each ``POST /v1/traces`` (protobuf, optionally gzipped) with ``opentelemetry-proto``,
keeps every span as a ``Span`` and every raw body (what went over the wire, so a test can search
it for text that must never leave the process), and answers 200 with an empty response.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.support.local_server import LocalServer
from tests.support.waiting import eventually_sync

__all__ = ["Receiver", "Span", "decode"]

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, or "" for a root span
    kind: str  # SERVER, CONSUMER, INTERNAL, ... (OTLP's SPAN_KIND_ prefix dropped)
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(hash=False)
    status: str  # UNSET, OK or ERROR (STATUS_CODE_ prefix dropped)
    resource: dict[str, Any] = field(hash=False)  # the exporting process's: service.name, ...
    events: tuple[str, ...] = ()  # event names

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")

    def brief(self) -> str:
        """One line for a failure message."""
        return (f"{self.service}:{self.name} trace={self.trace_id} span={self.span_id} "
                f"parent={self.parent_span_id or '-'} kind={self.kind} status={self.status} "
                f"[{self.start_ns}..{self.end_ns}] {self.attributes}")


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    if which is None:
        return None
    return getattr(v, which)


def _attributes(kvs: Sequence[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    """Every span of one ``ExportTraceServiceRequest`` body (already un-gzipped)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    kind=PbSpan.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes=_attributes(s.attributes),
                    status=Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                    resource=resource, events=tuple(e.name for e in s.events)))
    return spans


class Receiver(LocalServer):
    """``with Receiver() as rx:`` serves until the block ends; point exporters at ``rx.url``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._bodies: list[bytes] = []  # raw, as received (possibly gzipped)
        self._errors: list[str] = []  # requests it could not decode
        self._serve(self._handler(), "otlp-receiver")

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def bodies(self) -> list[bytes]:
        """Every request body as it arrived, and un-gzipped where it was gzipped."""
        with self._lock:
            raw = list(self._bodies)
        return raw + [gzip.decompress(b) for b in raw if b[:2] == b"\x1f\x8b"]

    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)

    def dump(self, spans: list[Span] | None = None) -> str:
        spans = self.spans() if spans is None else spans
        lines = [s.brief() for s in sorted(spans, key=lambda s: (s.trace_id, s.start_ns))]
        errors = self.errors()
        return "\n".join([f"{len(spans)} spans:", *lines, *([f"errors: {errors}"] if errors else [])])

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout_s: float = 30) -> list[Span]:
        """The spans once ``predicate`` holds over them all; AssertionError with what did
        arrive if it does not within ``timeout_s`` (exporters batch, so spans trickle in)."""
        def arrived() -> list[Span] | None:
            spans = self.spans()
            return spans if predicate(spans) else None
        return eventually_sync(arrived, timeout_s=timeout_s, what=lambda: f"spans that did not arrive\n{self.dump()}")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's requests session expects

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != TRACES_PATH:
                    return self._answer(404, b"", "text/plain")
                if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/x-protobuf":
                    return self._answer(415, b"", "text/plain")
                try:
                    data = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
                    spans = decode(data)
                except Exception as exc:  # noqa: BLE001 - kept for the test's failure message
                    with rx._lock:
                        rx._bodies.append(body)
                        rx._errors.append(f"{type(exc).__name__}: {exc}")
                    return self._answer(400, b"", "text/plain")
                with rx._lock:
                    rx._bodies.append(body)
                    rx._spans.extend(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

            def _answer(self, status: int, payload: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet under pytest
                pass

        return Handler
