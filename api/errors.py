"""Errors mapped to HTTP once, in the shape of the dialect the route speaks.

Typed ServiceErrors keep their status; a Redis outage or refusal (memory, failover) is 503;
anything unexpected is a logged 500, never a 400. A route that answers in another dialect than
its own (LMI's ``/invocations`` with an OpenAI body) says so explicitly with :func:`answered_in`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import ExceptionHandlersMap

from api import dialects
from shared.codec import encode
from shared.errors import (
    HttpError,
    InternalError,
    PayloadTooLarge,
    QueueRefused,
    QueueUnavailable,
    RateLimited,
    ServiceError,
    SloUnattainable,
)
from shared.redis import REDIS_DOWN, refusal
from shared.schemas import DialectName

__all__ = ["exception_handlers", "answered_in", "InDialect", "service_error"]

log = structlog.get_logger()

T = TypeVar("T")


class InDialect(Exception):
    """An error to answer in ``dialect``'s shape rather than the route's."""

    def __init__(self, dialect: DialectName, error: Exception) -> None:
        super().__init__(dialect)
        self.dialect, self.error = dialect, error


async def answered_in(dialect: DialectName, call: Awaitable[T]) -> T:
    """Await ``call``; whatever it raises is answered in ``dialect``'s error shape."""
    try:
        return await call
    except Exception as exc:
        raise InDialect(dialect, exc) from None


def _dialect(request: Request) -> DialectName:
    handler = request.scope.get("route_handler")
    return handler.opt.get("dialect", "jobs") if handler is not None else "jobs"


def service_error(exc: Exception) -> ServiceError:
    """The ServiceError an exception answers as (logged when it is no client's fault)."""
    if isinstance(exc, ServiceError):
        return exc
    if (refused := refusal(exc)) is not None:
        log.warning("redis_refused", error=str(refused))
        return QueueRefused("the queue takes no new work right now; retry shortly with the same Idempotency-Key")
    if isinstance(exc, REDIS_DOWN):
        log.warning("redis_unavailable", error=str(exc))
        return QueueUnavailable("the queue is unavailable; try again shortly")
    if isinstance(exc, RequestEntityTooLarge):  # LLMQ_MAX_BODY_BYTES, enforced while Litestar reads the body
        return PayloadTooLarge("Request body too large: the limit is set by LLMQ_MAX_BODY_BYTES")
    if isinstance(exc, HTTPException):  # Litestar's own (405, 413, ...): keep its status
        return HttpError(str(exc.detail), status=exc.status_code)
    log.exception("unhandled_error", error_type=type(exc).__name__, may_quote_request=True)
    return InternalError("internal server error")


def handle(request: Request, exc: Exception) -> Response:
    dialect = _dialect(request)
    if isinstance(exc, InDialect):
        dialect, exc = exc.dialect, exc.error
    err = service_error(exc)
    status, body = dialects.error_body(dialect, err)
    services = getattr(request.app.state, "services", None)  # None before the lifespan ran
    if services is not None:
        services.errors[(status, err.code)] = services.errors.get((status, err.code), 0) + 1
    headers = None
    if status in (429, 503, 529):  # 529: Anthropic's overloaded_error, its full queue
        # A tenant's own limit, or a missed SLO's margin, says when to try again; anything else: soon.
        headers = {"Retry-After": str(err.retry_after_s if isinstance(err, RateLimited | SloUnattainable) else 1)}
    elif status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return Response(encode(body), status_code=status, media_type="application/json", headers=headers)


exception_handlers: ExceptionHandlersMap = {Exception: handle}
