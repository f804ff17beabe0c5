"""TGI routes: ``POST /generate``, ``/generate_stream``, ``/`` (compat), ``/tokenize``, and
``GET /info``, ``/health``; plus the stream framing (the translation is ``api.dialects.tgi``).

Streams never fail with an HTTP status: once the body parses, validation, queueing and
generation errors all arrive as one in-band ``data:{"error":...}`` event after a 200, as TGI
does. A body that does not parse is refused before the stream starts (422), like axum's Json
extractor.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from api import tokenizer
from api.context import Ctx, RequestContext
from api.dialects import tgi
from api.http import accepted, decode_body, json_response, stream_response
from api.relay import collect
from api.services import Services, Svc
from api.submit import submit
from shared.errors import QueueUnavailable, ServiceError
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.framing import KEEPALIVE, Keepalive, sse
from shared.redis import REDIS_DOWN
from shared.schemas import GenerationRequest, JobResult

__all__ = ["ROUTES", "render_stream"]

SSE = "text/event-stream"
_OPT = {"dialect": tgi.NAME}


async def _translate(svc: Services, body: tgi.GenerateRequest, *, stream: bool, compat: bool) -> GenerationRequest:
    req = tgi.to_generation_request(body, stream=stream, max_total_tokens=svc.settings.max_model_len, compat=compat)
    truncate = body.parameters.truncate if body.parameters is not None else None
    if truncate is not None:
        # TGI keeps the last `truncate` tokens of the input (special tokens included).
        ids = (await tokenizer.encode(svc.settings, body.inputs)).ids
        if len(ids) > truncate:
            req = msgspec.structs.replace(req, prompt=None, prompt_token_ids=ids[-truncate:])
    return req


async def _close(events: AsyncIterator[Any]) -> None:
    """Release the job's subscription now, not whenever the generator is collected."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


# --- non-streaming --------------------------------------------------------------------------


async def _collect(
    events: AsyncIterator[Event | Keepalive], special: frozenset[int]
) -> tuple[JobResult, dict[int, list[dict[str, Any]]]]:
    """Fold the job as relay.collect does, keeping each event's TGI tokens, so a non-streamed
    answer has exactly the tokens (and texts) a stream would have sent."""
    tokens: dict[int, list[dict[str, Any]]] = {}
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
    special = await tokenizer.special_ids(svc.settings)
    sub = await submit(svc, ctx, req)
    result, tokens = await _collect(sub.events, special)
    out = tgi.render_result(sub.request, result, inputs=body.inputs, tokens=tokens, special=special)
    headers = {
        "x-prompt-tokens": str(result.usage.prompt_tokens),
        "x-generated-tokens": str(result.usage.completion_tokens),
    }
    return json_response([out] if compat else out, headers=headers)


# --- streaming ------------------------------------------------------------------------------


def _event(index: int, token: dict, top: list | None, text: str | None, details: dict | None) -> bytes:
    """A StreamResponse: ``top_tokens`` only when asked for (TGI skips an empty list)."""
    event: dict[str, Any] = {"index": index, "token": token}
    if top:
        event["top_tokens"] = top
    event["generated_text"] = text
    event["details"] = details
    return sse(event, space=False)


def _stream_details(req: GenerationRequest, done: Done, generated: int) -> dict[str, Any] | None:
    if not req.output.details:
        return None
    final = done.deltas[-1] if done.deltas else TokenDelta()
    return {
        "finish_reason": tgi.finish_reason(final.finish_reason, final.stop_reason),
        "generated_tokens": generated,
        "seed": tgi.reported_seed(req),
        "input_length": done.usage.prompt_tokens,
    }


async def render_stream(
    req: GenerationRequest,
    events: AsyncIterator[Event | Keepalive],
    *,
    inputs: str,
    special: frozenset[int] = frozenset(),
) -> AsyncIterator[bytes]:
    """One event per token, counted from 1; the last token's event also carries
    ``generated_text`` and ``details``."""
    index, generated, parts, texts = 0, 0, [], tgi.TokenTexts(special)
    try:
        async for event in events:
            if isinstance(event, Keepalive):
                yield KEEPALIVE
                continue
            if isinstance(event, Error):
                yield tgi.error_frame(event.exception())
                return
            pending: list[tuple[dict, list | None]] = []
            for d in event.deltas:
                parts.append(d.text)
                generated += len(d.token_ids)
                tops = tgi.top_tokens_of(d.top_logprobs, special)
                pending += [(t, tops[i] if i < len(tops) else None) for i, t in enumerate(texts.delta(d))]
            if not isinstance(event, Done):
                for tok, top in pending:
                    index += 1
                    yield _event(index, tok, top, None, None)
                continue
            # Done carries the last engine step's tokens: its last token is the final event.
            last = pending.pop() if pending else (tgi.token(0, "", None, True), None)
            for tok, top in pending:
                index += 1
                yield _event(index, tok, top, None, None)
            text = tgi.full_text_prefix(req, inputs) + "".join(parts)
            yield _event(index + 1, *last, text, _stream_details(req, event, generated))
            return
        yield tgi.error_frame(tgi.IncompleteGenerationStream("Incomplete generation stream"))
    except ServiceError as exc:  # the relay itself failed (say, Redis went away mid-stream)
        yield tgi.error_frame(exc)


async def _stream(svc: Services, ctx: RequestContext, body: tgi.GenerateRequest, *, compat: bool
                  ) -> Response | Stream:
    if ctx.respond_async:  # queued and answered 202 (errors as statuses: no stream has started)
        return await accepted(svc, ctx, await _translate(svc, body, stream=True, compat=compat))

    async def frames() -> AsyncIterator[bytes]:
        try:
            req = await _translate(svc, body, stream=True, compat=compat)
            special = await tokenizer.special_ids(svc.settings)
            sub = await submit(svc, ctx, req, keepalive=True)
        except ServiceError as exc:
            yield tgi.error_frame(exc)
            return
        except REDIS_DOWN:
            yield tgi.error_frame(QueueUnavailable("the queue is unavailable; try again shortly"))
            return
        try:
            async for frame in render_stream(sub.request, sub.events, inputs=body.inputs, special=special):
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
    enc = await tokenizer.encode(svc.settings, body.inputs)
    text = body.inputs
    pairs = zip(enc.ids, enc.offsets, strict=True)
    return json_response([{"id": tid, "text": text[a:b], "start": a, "stop": b} for tid, (a, b) in pairs])


def _version() -> str:
    try:
        return importlib.metadata.version("llmq")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


@get("/info", opt=_OPT)
async def info(svc: Svc) -> Response:
    limit = svc.settings.max_model_len
    return json_response(
        {
            "model_id": svc.model,
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            # Nothing caps requests in flight (they queue); one engine's batch is the closest figure.
            "max_concurrent_requests": svc.settings.max_num_seqs,
            "max_best_of": tgi.MAX_BEST_OF,
            "max_stop_sequences": tgi.MAX_STOP_SEQUENCES,
            "max_input_tokens": limit - 1,
            "max_total_tokens": limit,
            "validation_workers": 1,
            "max_client_batch_size": tgi.MAX_CLIENT_BATCH_SIZE,
            "router": "llmq",
            "version": _version(),
            "sha": None,
            "docker_label": None,
        }
    )


@get("/health", opt=_OPT)
async def health(svc: Svc) -> Response:
    """200 with an empty body while a warm worker serves the default model, else TGI's 503."""
    if (await svc.models.live()).get(svc.model, 0):
        return Response(b"", status_code=200, media_type="text/plain")
    return json_response({"error": "unhealthy", "error_type": "healthcheck"}, 503)


ROUTES: list = [generate, generate_stream, compat_generate, tokenize, info, health]
