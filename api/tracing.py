"""The API's span of each HTTP request: continued from the client's ``traceparent``, ended after
the last byte of the response is sent (a streamed answer's span lasts as long as its relay).

Installed only with tracing on (api/app.py): :class:`Traced` is the outermost ASGI middleware. It
hands the request's :class:`RequestSpan` to the route through the ASGI scope (read once, by
:func:`api.context.request_context`, into the request's context), and :func:`api.submit.submit`
writes its ``traceparent`` into every job record the request queues, which is how the worker's
spans join the trace. No prompt or body text ever becomes an attribute.
"""

from __future__ import annotations

import structlog
from litestar.datastructures import Headers
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from api.context import SPAN
from shared import tracing as t
from shared.events import Done, Error, Event
from shared.tracing import Tracing

__all__ = ["Traced", "RequestSpan", "UNTRACED_PATHS"]

UNTRACED_PATHS = frozenset({"/metrics", "/ping", "/livez", "/readyz", "/health"})
"""Scrapes and probes: a span each would bury the requests an operator is looking for."""


class RequestSpan:
    """One HTTP request's span, and what the route tells it (its jobs, their end)."""

    __slots__ = ("span", "traceparent", "trace_id", "job_ids")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.traceparent = t.traceparent_of(span)
        self.trace_id = t.trace_id_of(span)
        self.job_ids: list[str] = []

    def queued(self, job_id: str, model: str, tenant: str, dialect: str) -> None:
        self.job_ids.append(job_id)
        if len(self.job_ids) == 1:
            self.span.set_attributes({t.JOB_ID: job_id, t.MODEL: model, t.TENANT: tenant, t.DIALECT: dialect})
        else:  # a list of prompts: several jobs, one request
            self.span.set_attribute("llmq.job_ids", self.job_ids)

    def ended(self, event: Event) -> None:
        """The job's terminal event, as the relay passes it on."""
        match event:
            case Done(usage=usage, deltas=deltas):
                self.span.set_attributes({t.INPUT_TOKENS: usage.prompt_tokens,
                                          t.OUTPUT_TOKENS: usage.completion_tokens})
                reasons = [d.finish_reason for d in deltas if d.finish_reason]
                if reasons:
                    self.span.set_attribute(t.FINISH_REASONS, reasons)
            case Error(code=code):
                self.span.set_attribute(t.ERROR_TYPE, code)
                self.span.set_status(Status(StatusCode.ERROR, code))


class Traced:
    """ASGI middleware: a SERVER span per HTTP request (WebSockets, such as LMTP's, are not
    traced per socket: their jobs start traces of their own on the worker)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracer = tracing.tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        parent = t.parent_context(Headers.from_scope(scope).get(t.TRACEPARENT))
        # Litestar runs app middleware after routing (a path no route matches is answered 404
        # before it): the span is named by its route's template, never by the path, whose ids
        # would make every name unique.
        route = scope.get("path_template", "")
        span = self.tracer.start_span(f"{method} {route}".rstrip(), context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": scope["path"],
                                                  "http.route": route})
        request = RequestSpan(span)
        scope[SPAN] = request  # type: ignore[literal-required]  # our own key: Litestar's Scope lists its own
        # Copied into the handler's task (api.middleware.RequestLifecycle creates it after this).
        structlog.contextvars.bind_contextvars(trace_id=request.trace_id)

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            # The type only: an exception's message may quote the request.
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()  # the last body message has been sent: the relay's end
