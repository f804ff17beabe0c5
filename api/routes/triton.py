"""Triton routes: the generate extension and the KServe v2 health and metadata endpoints.

Triton's route regex takes numeric versions only (``/versions/([0-9]+)``), so any other version
is its plain 404 ``{"error": "Not Found"}``. llmq serves every model as version "1". A model
exists when the deployment knows it (configured, or ever served: its requests queue); it is
*ready* while a warm worker serves it.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from litestar import Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import triton as tr
from api.dialects.stream import SSE
from api.http import decode_body, json_response, stream_frames
from api.operations import ASYNC, ASYNC_HEADERS, JSON, TEXT, documented
from api.services import Services, Svc
from shared.errors import InvalidRequest, ModelNotFound
from shared.framing import sse
from shared.redis import REDIS_DOWN
from shared.schemas import JobResult

__all__ = ["ROUTES"]

# SSE: Litestar adds "; charset=utf-8" to text/event-stream, which is exactly Triton's header.
_OPT = {"dialect": tr.NAME}
_MODEL = "/v2/models/{model:str}"
_VERSIONED = "/v2/models/{model:str}/versions/{version:str}"
# What the four generate routes declare alike. Triton reports "overloaded" and an expired queue
# timeout as 503.
_GENERATE: dict[str, Any] = {
    "tag": "triton", "body": "triton", "ok": {200: (JSON, SSE), **ASYNC}, "errors": (400, 404, 503),
    "headers": ASYNC_HEADERS, "answer": tr.GenerateResponse, "error": tr.ErrorResponse,
    "examples": ({"text_input": "Hello", "parameters": {"max_tokens": 4}},
                 {"text_input": "Hi", "max_tokens": 2, "stream": True}),
}


def _version_number(version: str | None) -> int | None:
    if version is None:
        return None
    if not (version.isascii() and version.isdigit()):
        raise ModelNotFound("Not Found")  # Triton's route regex did not match: its generic 404
    return int(version)


async def _check_model(svc: Services, model: str, version: str | None) -> None:
    """Triton looks the model (and version) up before reading the body: 404 in its words."""
    number = _version_number(version)
    if model not in await svc.models.known() and model not in await svc.models.known(fresh=True):
        raise ModelNotFound(f"Request for unknown model: '{model}' is not found")
    if number is not None and str(number) != tr.MODEL_VERSION:
        raise ModelNotFound(f"Request for unknown model: '{model}' version {number} is not found")


async def _generate(
    request: Request, svc: Services, ctx: RequestContext, model: str, version: str | None, *, streaming: bool
) -> Response:
    await _check_model(svc, model, version)
    body = tr.read_body(await decode_body(request, tr.RawBody))
    req, opts = tr.to_generation_request(body, model)

    def whole(q: jobs.Queued, results: list[JobResult]) -> object:
        # /generate answers with one object; /generate_stream without `stream: true` sends the
        # backend's single (whole) response as one event.
        answer = tr.render_response(q.request, results[0], opts)
        return stream_frames([sse(answer)], SSE) if streaming else answer

    return await jobs.respond(svc, ctx, req, stream=streaming and opts.stream, whole=whole,
                              renderer=lambda q: tr.TritonStream(q.request, opts=opts))


def _generate_routes(name: str, *, streaming: bool) -> tuple[HTTPRouteHandler, HTTPRouteHandler]:
    """The generate extension's route ``name`` at a model's path and at one of its versions' (Triton
    serves both), each answered by :func:`_generate`."""

    @documented(f"Triton {name}", **_GENERATE)
    @post(f"{_MODEL}/{name}", opt=_OPT, status_code=200)
    async def of_model(request: Request, svc: Svc, ctx: Ctx, model: FromPath[str]) -> Response:
        return await _generate(request, svc, ctx, model, None, streaming=streaming)

    @documented(f"Triton {name}", **_GENERATE)
    @post(f"{_VERSIONED}/{name}", opt=_OPT, status_code=200)
    async def of_version(
        request: Request, svc: Svc, ctx: Ctx, model: FromPath[str], version: FromPath[str]
    ) -> Response:
        return await _generate(request, svc, ctx, model, version, streaming=streaming)

    return of_model, of_version


generate, generate_versioned = _generate_routes("generate", streaming=False)
generate_stream, generate_stream_versioned = _generate_routes("generate_stream", streaming=True)


# --- health and metadata --------------------------------------------------------------------


def _empty(status: int) -> Response:
    """Triton's health answers: a bare status, no body."""
    return Response(b"", status_code=status, media_type="text/plain")


async def _model_ready(svc: Services, model: str) -> bool:
    try:
        return model in await svc.models.live(fresh=True)
    except REDIS_DOWN:
        return False  # cannot see the workers: not ready (Triton's "not ready" is 400, not 503)


def _llmq_version() -> str:
    try:
        return importlib.metadata.version("llmq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"  # run from a source tree


@documented("KServe server metadata", "triton", answer=tr.ServerMetadataResponse)
@get("/v2", opt=_OPT)
async def server_metadata() -> Response:
    return json_response(
        tr.ServerMetadataResponse(name="llmq", version=_llmq_version(), extensions=["generate", "parameters"])
    )


@documented("KServe liveness", "health", ok={200: (TEXT,)})
@get("/v2/health/live", opt=_OPT)
async def health_live() -> Response:
    return _empty(200)


@documented("KServe readiness", "health", ok={200: (TEXT,), 400: (TEXT,)})
@get("/v2/health/ready", opt=_OPT)
async def health_ready(svc: Svc) -> Response:
    return _empty(200 if await _model_ready(svc, svc.model) else 400)


async def _metadata(svc: Services, model: str, version: str | None) -> Response:
    await _check_model(svc, model, version)
    return json_response(
        tr.ModelMetadataResponse(
            name=model,
            versions=[tr.MODEL_VERSION],
            platform="vllm",
            inputs=tr.METADATA_INPUTS,
            outputs=tr.METADATA_OUTPUTS,
        )
    )


@documented("KServe model metadata", "triton", errors=(404, 503), answer=tr.ModelMetadataResponse,
            error=tr.ErrorResponse)
@get(_MODEL, opt=_OPT)
async def model_metadata(svc: Svc, model: FromPath[str]) -> Response:
    return await _metadata(svc, model, None)


@documented("KServe model metadata", "triton", errors=(404, 503), answer=tr.ModelMetadataResponse,
            error=tr.ErrorResponse)
@get(_VERSIONED, opt=_OPT)
async def model_metadata_versioned(svc: Svc, model: FromPath[str], version: FromPath[str]) -> Response:
    return await _metadata(svc, model, version)


async def _ready(svc: Services, model: str, version: str | None) -> Response:
    number = _version_number(version)
    if (number is None or str(number) == tr.MODEL_VERSION) and await _model_ready(svc, model):
        return _empty(200)
    # Triton answers an unknown model the same way: it is simply not ready.
    raise InvalidRequest("Model version not ready")


@documented("KServe model readiness", "health", ok={200: (TEXT,)}, errors=(400, 404))
@get(f"{_MODEL}/ready", opt=_OPT)
async def model_ready(svc: Svc, model: FromPath[str]) -> Response:
    return await _ready(svc, model, None)


@documented("KServe model readiness", "health", ok={200: (TEXT,)}, errors=(400, 404))
@get(f"{_VERSIONED}/ready", opt=_OPT)
async def model_ready_versioned(svc: Svc, model: FromPath[str], version: FromPath[str]) -> Response:
    return await _ready(svc, model, version)


ROUTES: list = [
    generate,
    generate_versioned,
    generate_stream,
    generate_stream_versioned,
    server_metadata,
    health_live,
    health_ready,
    model_metadata,
    model_metadata_versioned,
    model_ready,
    model_ready_versioned,
]
