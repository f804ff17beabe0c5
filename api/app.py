"""The Litestar app factory: wiring only. ``uvicorn --factory api.app:create_app``."""

from __future__ import annotations

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from api.auth import KeyGuard, parse_keys
from api.context import job_ref, request_context
from api.errors import exception_handlers
from api.http import RequestLifecycle
from api.metrics import metrics, pushing
from api.openapi import openapi_json
from api.routes import (
    anthropic,
    anthropic_batches,
    batches,
    happy_vllm,
    health,
    jobs,
    lmi,
    lmtp,
    openai,
    openai_chat,
    openai_responses,
    tgi,
    triton,
    usage,
)
from api.services import Services, lifespan
from shared.config import Settings, load_settings
from shared.logging import configure_logging

__all__ = ["create_app"]


def _services(state: State) -> Services:
    return state.services


def create_app(settings: Settings | None = None) -> Litestar:
    if settings is None:  # the entrypoint: load settings (and logging) exactly once, here
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    keys = parse_keys(settings.api_keys)
    guard = KeyGuard(keys) if keys else None
    return Litestar(
        route_handlers=[
            lmi.invocations,
            lmi.predictions,
            openai.completions,
            openai.models,
            jobs.create_job,
            jobs.get_job,
            jobs.cancel_job,
            jobs.job_events,
            usage.usage,
            health.ping,
            health.livez,
            health.readyz,
            *tgi.ROUTES,
            *triton.ROUTES,
            *happy_vllm.ROUTES,
            *lmtp.ROUTES,
            *openai_chat.ROUTES,
            *anthropic.ROUTES,
            *anthropic_batches.ROUTES,
            *openai_responses.ROUTES,
            *batches.ROUTES,
            openapi_json,
            metrics,
        ],
        dependencies={
            "svc": Provide(_services, sync_to_thread=False),
            "ctx": Provide(request_context, sync_to_thread=False),
            "job": Provide(job_ref),
        },
        lifespan=[lifespan, pushing],
        exception_handlers=exception_handlers,
        # Guards run after routing, so a 401 renders in the route's dialect.
        guards=[guard] if guard is not None else None,
        middleware=[lambda app: RequestLifecycle(app, guard)],
        request_max_body_size=settings.max_body_bytes,
        state=State({"settings": settings}),
        openapi_config=None,  # the document is api.openapi's (routes read their own bodies)
        logging_config=None,  # keep structlog's set-up (configure_logging), not Litestar's default
    )
