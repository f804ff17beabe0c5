"""The Litestar app factory: wiring only. ``uvicorn --factory api.app:create_app``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from api.auth import KeyGuard, KeylessGuard, configured_keys, refuse_open_bind
from api.context import job_ref, request_context
from api.direct import DirectCalls
from api.errors import exception_handlers
from api.metrics import pushing
from api.middleware import RequestLifecycle
from api.openapi import HTTP_ROUTES
from api.routes import console, lmtp
from api.services import Services, lifespan
from shared.config import Settings, load_settings, load_tracing
from shared.logging import configure_logging

if TYPE_CHECKING:
    from shared.tracing import Tracing

__all__ = ["create_app"]


def _services(state: State) -> Services:
    return state.services


def create_app(settings: Settings | None = None, tracing: Tracing | None = None) -> Litestar:
    """``tracing``: the process's tracer (shared/tracing.py), None with tracing off; the
    entrypoint builds it from the OTEL_* variables."""
    if settings is None:  # the entrypoint: load settings (and logging) exactly once, here
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
        refuse_open_bind(settings)  # `uvicorn --factory`: as `python -m api` does, judged by LLMQ_HOST
        tracing = load_tracing("llmq-api", "api")
    keys = configured_keys(settings)
    guard = KeyGuard(keys) if keys else KeylessGuard(settings.allowed_host_names)  # asked by RequestLifecycle
    # The innermost calls most handlers itself, past Litestar's per-request handler layer.
    middleware: list = [lambda app: RequestLifecycle(app, guard),
                        lambda app: DirectCalls(app, _services, request_context)]
    if tracing is not None:
        from api.tracing import Traced

        middleware.insert(0, lambda app: Traced(app, tracing))  # outermost: its span ends after the last byte
    hidden = () if settings.console else console.ROUTES  # LLMQ_CONSOLE off: no page, no files
    return Litestar(
        # Every HTTP route is a documented one (api/openapi.py); the LMTP WebSocket cannot be.
        route_handlers=[*(route for route in HTTP_ROUTES if route not in hidden), *lmtp.ROUTES],
        dependencies={
            "svc": Provide(_services, sync_to_thread=False),
            "ctx": Provide(request_context, sync_to_thread=False),
            "job": Provide(job_ref),
        },
        lifespan=[lifespan, pushing],
        on_shutdown=[tracing.shutdown] if tracing is not None else None,
        exception_handlers=exception_handlers,
        middleware=middleware,
        request_max_body_size=settings.max_body_bytes,
        state=State({"settings": settings}),
        openapi_config=None,  # the document is api.openapi's (routes read their own bodies)
        logging_config=None,  # keep structlog's set-up (configure_logging), not Litestar's default
    )
