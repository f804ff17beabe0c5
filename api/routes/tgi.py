"""TGI routes: ``POST /generate``, ``/generate_stream``, ``/`` (compat), ``/tokenize``, and
``GET /info``, ``/health``. The translation and the stream's events are ``api.dialects.tgi``.

Streams never fail with an HTTP status: once the body parses, validation, queueing and
generation errors all arrive as one in-band ``data:{"error":...}`` event after a 200, as TGI
does. A body that does not parse is refused before the stream starts (422), like axum's Json
extractor.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from api.context import Ctx, RequestContext
from api.dialects import tgi
from api.http import accepted, decode_body, json_response, stream_response
from api.relay import collect
from api.services import Services, Svc
from api.submit import submit
from shared.errors import QueueUnavailable, ServiceError
from shared.events import Done, Event, Tokens
from shared.framing import Keepalive
from shared.redis import REDIS_DOWN
from shared.schemas import GenerationRequest, JobResult

__all__ = ["ROUTES"]

SSE = "text/event-stream"
_OPT = {"dialect": tgi.NAME}


async def _translate(svc: Services, body: tgi.GenerateRequest, *, stream: bool, compat: bool) -> GenerationRequest:
    req = tgi.to_generation_request(body, stream=stream, max_total_tokens=svc.settings.max_model_len, compat=compat)
    truncate = body.parameters.truncate if body.parameters is not None else None
    if truncate is not None:
        # TGI keeps the last `truncate` tokens of the input (special tokens included).
        ids = (await svc.tokenizer.encode(body.inputs)).ids
        if len(ids) > truncate:
            req = msgspec.structs.replace(req, prompt=None, prompt_token_ids=ids[-truncate:])
    return req


async def _close(events: AsyncIterator[object]) -> None:
    """Release the job's subscription now, not whenever the generator is collected."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


# --- non-streaming --------------------------------------------------------------------------


async def _collect(
    events: AsyncIterator[Event | Keepalive], special: frozenset[int]
) -> tuple[JobResult, dict[int, list[tgi.Token]]]:
    """Fold the job as relay.collect does, keeping each event's TGI tokens, so a non-streamed
    answer has exactly the tokens (and texts) a stream would have sent."""
    tokens: dict[int, list[tgi.Token]] = {}
    texts: dict[int, tgi.TokenTexts] = {}

    def keep_tokens(event: Tokens | Done) -> None:
        for delta in event.deltas:
            seq_texts = texts.setdefault(delta.index, tgi.TokenTexts(special))
            tokens.setdefault(delta.index, []).extend(seq_texts.delta(delta))

    try:
        result = await collect(events, keep_tokens)
    finally:
        await _close(events)
    return result, tokens


async def _generate(svc: Services, ctx: RequestContext, body: tgi.GenerateRequest, *, compat: bool) -> Response:
    req = await _translate(svc, body, stream=False, compat=compat)
    if ctx.respond_async:
        return await accepted(svc, ctx, req)
    special = await svc.tokenizer.special_ids()
    sub = await submit(svc, ctx, req)
    result, tokens = await _collect(sub.events, special)
    out = tgi.render_result(sub.request, result, inputs=body.inputs, tokens=tokens, special=special)
    headers = {
        "x-prompt-tokens": str(result.usage.prompt_tokens),
        "x-generated-tokens": str(result.usage.completion_tokens),
    }
    return json_response([out] if compat else out, headers=headers)


# --- streaming ------------------------------------------------------------------------------


async def _stream(svc: Services, ctx: RequestContext, body: tgi.GenerateRequest, *, compat: bool
                  ) -> Response | Stream:
    if ctx.respond_async:  # queued and answered 202 (errors as statuses: no stream has started)
        return await accepted(svc, ctx, await _translate(svc, body, stream=True, compat=compat))

    async def frames() -> AsyncIterator[bytes]:
        try:
            req = await _translate(svc, body, stream=True, compat=compat)
            special = await svc.tokenizer.special_ids()
            sub = await submit(svc, ctx, req, keepalive=True)
        except ServiceError as exc:
            yield tgi.error_frame(exc)
            return
        except REDIS_DOWN:
            yield tgi.error_frame(QueueUnavailable("the queue is unavailable; try again shortly"))
            return
        try:
            async for frame in tgi.render_stream(sub.request, sub.events, inputs=body.inputs, special=special):
                yield frame
        finally:
            await _close(sub.events)

    return stream_response(frames(), SSE)


# --- routes ---------------------------------------------------------------------------------


@post("/generate", opt=_OPT, status_code=200)
async def generate(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _generate(svc, ctx, await decode_body(request, tgi.GenerateRequest), compat=False)


@post("/generate_stream", opt=_OPT, status_code=200)
async def generate_stream(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    return await _stream(svc, ctx, await decode_body(request, tgi.GenerateRequest), compat=False)


@post("/", opt=_OPT, status_code=200)
async def compat_generate(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    """``stream: false`` answers a one-element array (as api-inference does); ``true`` streams."""
    body = await decode_body(request, tgi.GenerateRequest)
    if body.stream:
        return await _stream(svc, ctx, body, compat=True)
    return await _generate(svc, ctx, body, compat=True)


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


@get("/info", opt=_OPT)
async def info(svc: Svc) -> Response:
    limit = svc.settings.max_model_len
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


@get("/health", opt=_OPT)
async def health(svc: Svc) -> Response:
    """200 with an empty body while a warm worker serves the default model, else TGI's 503."""
    if (await svc.models.live()).get(svc.model, 0):
        return Response(b"", status_code=200, media_type="text/plain")
    return json_response(tgi.ErrorResponse("unhealthy", "healthcheck"), 503)


ROUTES: list = [generate, generate_stream, compat_generate, tokenize, info, health]
