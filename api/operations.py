"""Each route's OpenAPI operation, declared beside the route: ``@documented(...)`` over its
``@get``/``@post``/``@delete``.

Routes read their own bodies (``api.http.decode_body``), so Litestar's generator would know no
request bodies; a route says here what it reads and answers instead, and ``api/openapi.py``
assembles the document from these declarations. The method and path are the route handler's
own, read from it, so a path is written once: in the route's decorator.

This module imports no route and no part of the document's assembly, so every route module may
import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from litestar.handlers import HTTPRouteHandler

from api.dialects import openai_completions

__all__ = [
    "ASYNC",
    "ASYNC_HEADERS",
    "CHAT_EXAMPLE",
    "JSON",
    "JSONLINES",
    "NDJSON",
    "OPENAI_ERROR",
    "OPENAI_ERRORS",
    "TEXT",
    "TGI_EXAMPLE",
    "Operation",
    "documented",
    "openapi_path",
    "operation_of",
]

# Media types (SSE's is api.dialects.stream.SSE).
JSON = "application/json"
NDJSON = "application/x-ndjson"
JSONLINES = "application/jsonlines"
TEXT = "text/plain"


class Operation(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    path: str
    """OpenAPI style: ``{model}``, not Litestar's ``{model:str}``."""
    summary: str
    tag: str
    body: str | None = None
    """A key of the body schemas (``api.openapi._bodies``), or None for no body."""
    examples: tuple[dict[str, Any], ...] = ()
    """Request bodies that succeed (with the default model): documentation, and schemathesis's
    examples phase."""
    ok: dict[int, tuple[str, ...]] = msgspec.field(default_factory=lambda: {200: (JSON,)})
    """Success (and other non-error) statuses -> the media types each may carry."""
    errors: tuple[int, ...] = ()
    """The error statuses the route's own code answers with. The document adds the ones every
    route shares: 401 to every non-open operation when API keys are on, 403 to every one but the
    health probes when they are off; 413 wherever a body is read."""
    headers: tuple[str, ...] = ()
    """Request headers the route reads: ``Prefer``, ``Idempotency-Key``, ``Last-Event-ID``."""
    query: tuple[str, ...] = ()
    body_media: str = JSON
    queues: bool = True
    """With a body: the route queues work, so it reads the deadline and priority headers
    (``api.submit.admit``). False for a body that queues nothing (tokenize, an upload)."""
    answer: Any = None
    """The type of the 200 answer's JSON body (a Struct, a list or a union of them); None: not
    described (LMI's answers depend on the body and the deployment's settings)."""
    error: Any = None
    """The type of an error's JSON body: the route's dialect's error shape."""


def openapi_path(litestar_path: str) -> str:
    """``/v2/models/{model:str}`` -> ``/v2/models/{model}``."""
    parts = litestar_path.split("/")
    return "/".join(p.split(":", 1)[0] + "}" if p.startswith("{") and ":" in p else p for p in parts)


def documented(summary: str, tag: str, **kw: Any) -> Callable[[HTTPRouteHandler], HTTPRouteHandler]:
    """Declare the operation of the route handler below: its method and path are the handler's,
    the rest is ``kw`` (:class:`Operation`'s fields). Kept in the handler's ``opt``, where
    :func:`operation_of` reads it."""

    def declare(handler: HTTPRouteHandler) -> HTTPRouteHandler:
        [method], [path] = handler.http_methods, handler.paths  # one each: one operation per route
        handler.opt["operation"] = Operation(method=method.lower(), path=openapi_path(path), summary=summary,
                                             tag=tag, **kw)
        return handler

    return declare


def operation_of(handler: HTTPRouteHandler) -> Operation:
    try:
        return handler.opt["operation"]
    except KeyError:
        raise LookupError(f"{handler.handler_name} declares no operation: put @documented(...) over its route") \
            from None


# Declarations several routes share. Error statuses come in the route's dialect's shape (see
# api/dialects/*.error_body): 503 everywhere (Redis unreachable); 504 where a request waits for
# its answer (its deadline, or its cold wait with no warm worker, ran out); 424 where it may be a
# job that killed its engine (engine_fault, docs/guarantees.md#dead-letter).
ASYNC = {202: (JSON,)}
"""Prefer: respond-async, or /v1/jobs: the job id, poll /v1/jobs/{id}."""
ASYNC_HEADERS = ("Prefer", "Idempotency-Key")
OPENAI_ERRORS = (400, 404, 424, 429, 503, 504)
OPENAI_ERROR = openai_completions.ErrorResponse
"""OpenAI's error shape: the OpenAI routes', the adapters' and the Files and Batches'."""
CHAT_EXAMPLE = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
"""Chat's example body; LMI's /invocations takes it too."""
TGI_EXAMPLE = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
"""TGI's example body; LMI's /invocations takes it too."""
