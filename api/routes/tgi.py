"""TGI routes: ``POST /generate``, ``/generate_stream``, ``/`` (compat), ``/tokenize``, and
``GET /info``, ``/health``. The translation and the stream's events are ``api.dialects.tgi``.

Streams never fail with an HTTP status: once the body parses, validation, queueing and
generation errors all arrive as one in-band ``data:{"error":...}`` event after a 200, as TGI
does. A body that does not parse is refused before the stream starts (422), like axum's Json
extractor.
"""

from __future__ import annotations

import importlib.metadata

import msgspec
from litestar import Request, Response, get, post

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import tgi
from api.dialects.stream import SSE
from api.errors import service_error
from api.http import EventStream, decode_body, json_response, stream_frames
from api.operations import ASYNC, ASYNC_HEADERS, JSON, TEXT, TGI_EXAMPLE, documented
from api.services import Services, Svc
from shared.errors import ServiceError
from shared.redis import REDIS_DOWN
from shared.schemas import GenerationRequest, JobResult

__all__ = ["ROUTES"]

_OPT = {"dialect": tgi.NAME}
_ERRORS = (404, 422, 424, 429, 503, 504)


async def _translate(svc: Services, body: tgi.GenerateRequest, *, stream: bool, compat: bool) -> GenerationRequest:
    # TGI's own max_new_tokens check, against the max_total_tokens its /info advertises.
    limit = await svc.models.context_length(svc.model, cached=True)
    req = tgi.to_generation_request(body, stream=stream, max_total_tokens=limit, compat=compat)
    truncate = body.parameters.truncate if body.parameters is not None else None
    if truncate is not None:
        # TGI keeps the last `truncate` tokens of the input (special tokens included).
        ids = (await svc.tokenizer.encode(body.inputs)).ids
        if len(ids) > truncate:
            req = msgspec.structs.replace(req, prompt=None, prompt_token_ids=ids[-truncate:])
    return req


async def _generate(svc: Services, ctx: RequestContext, body: tgi.GenerateRequest, *, compat: bool) -> Response:
    """The whole answer, its tokens kept event by event as a stream would have sent them."""
    req = await _translate(svc, body, stream=False, compat=compat)
    special = await svc.tokenizer.special_ids() if not ctx.respond_async else frozenset()
    recorder = tgi.TokenRecorder(special)

    def whole(q: jobs.Queued, results: list[JobResult]) -> Response:
        (result,) = results
        out = tgi.render_result(q.request, result, inputs=body.inputs, tokens=recorder.tokens, special=special)
        headers = {
            "x-prompt-tokens": str(result.usage.prompt_tokens),
            "x-generated-tokens": str(result.usage.completion_tokens),
        }
        return json_response([out] if compat else out, headers=headers)

    return await jobs.respond(svc, ctx, req, stream=False, whole=whole, seen=recorder.seen)


async def _stream(svc: Services, ctx: RequestContext, body: tgi.GenerateRequest, *, compat: bool) -> Response:
    """A stream always answers 200: an error before the first token (validation, the queue) is its
    one in-band event, as any later one is."""
    if ctx.respond_async:  # queued and answered 202 (errors as statuses: no stream has started)
        return await jobs.accepted(svc, ctx, [await _translate(svc, body, stream=True, compat=compat)])
    try:
        req = await _translate(svc, body, stream=True, compat=compat)
        special = await svc.tokenizer.special_ids()
        sub = await jobs.submit(svc, ctx, req, keepalive=True)
    except ServiceError as exc:
        return stream_frames([tgi.error_frame(exc)], SSE)
    except REDIS_DOWN as exc:  # an outage, or a refusal (memory, failover): as a status would say
        return stream_frames([tgi.error_frame(service_error(exc))], SSE)
    # Started at once, not held for the first event: every error from here on is in-band too.
    return EventStream(sub.events, tgi.TgiStream(sub.request, inputs=body.inputs, special=special))


# --- routes ---------------------------------------------------------------------------------


@documented("TGI generate", "tgi", body="tgi", examples=(TGI_EXAMPLE,), errors=_ERRORS, ok={200: (JSON,), **ASYNC},
            headers=ASYNC_HEADERS, answer=tgi.GenerateResponse, error=tgi.ErrorResponse)
@post("/generate", opt=_OPT, status_code=200)
async def generate(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _generate(svc, ctx, await decode_body(request, tgi.GenerateRequest), compat=False)


@documented("TGI stream (errors in-band)", "tgi", body="tgi", examples=(TGI_EXAMPLE,), ok={200: (SSE,), **ASYNC},
            errors=_ERRORS, headers=ASYNC_HEADERS, error=tgi.ErrorResponse)
@post("/generate_stream", opt=_OPT, status_code=200)
async def generate_stream(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _stream(svc, ctx, await decode_body(request, tgi.GenerateRequest), compat=False)


@documented("TGI compat: a one-element array, or a stream", "tgi", body="tgi",
            examples=(TGI_EXAMPLE, {**TGI_EXAMPLE, "stream": True}), ok={200: (JSON, SSE), **ASYNC}, errors=_ERRORS,
            headers=ASYNC_HEADERS, answer=list[tgi.GenerateResponse], error=tgi.ErrorResponse)
@post("/", opt=_OPT, status_code=200)
async def compat_generate(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """``stream: false`` answers a one-element array (as api-inference does); ``true`` streams."""
    body = await decode_body(request, tgi.GenerateRequest)
    if body.stream:
        return await _stream(svc, ctx, body, compat=True)
    return await _generate(svc, ctx, body, compat=True)


@documented("TGI tokenize", "tgi", body="tgi", examples=({"inputs": "Hello"},), errors=_ERRORS, queues=False,
            answer=list[tgi.SimpleToken], error=tgi.ErrorResponse)
@post("/tokenize", opt=_OPT, status_code=200)
async def tokenize(request: Request, svc: Svc) -> Response:
    """Each token with its slice of the input (character offsets; (0, 0) for added specials)."""
    body = await decode_body(request, tgi.GenerateRequest)
    enc = await svc.tokenizer.encode(body.inputs)
    text = body.inputs
    pairs = zip(enc.ids, enc.offsets, strict=True)
    return json_response([tgi.SimpleToken(tid, text[a:b], a, b) for tid, (a, b) in pairs])


def _version() -> str:
    try:
        return importlib.metadata.version("llmq")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


@documented("TGI info", "tgi", answer=tgi.Info)
@get("/info", opt=_OPT)
async def info(svc: Svc) -> Response:
    limit = await svc.models.context_length(svc.model)
    return json_response(
        tgi.Info(
            model_id=svc.model,
            # Nothing caps requests in flight (they queue); one engine's batch is the closest figure.
            max_concurrent_requests=svc.settings.max_num_seqs,
            max_input_tokens=limit - 1,
            max_total_tokens=limit,
            version=_version(),
        )
    )


@documented("TGI health", "health", ok={200: (TEXT,), 503: (JSON,)})
@get("/health", opt=_OPT)
async def health(svc: Svc) -> Response:
    """200 with an empty body while a warm worker serves the default model, else TGI's 503."""
    if (await svc.models.live()).get(svc.model, 0):
        return Response(b"", status_code=200, media_type="text/plain")
    return json_response(tgi.ErrorResponse("unhealthy", "healthcheck"), 503)


ROUTES: list = [generate, generate_stream, compat_generate, tokenize, info, health]
