"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.response import Stream

from api.context import Ctx
from api.dialects import anthropic_messages as am
from api.http import accepted, decode_body, event_stream, json_response
from api.relay import collect
from api.services import Svc
from api.submit import submit
from api.tokenizer import TokenizerUnavailable

__all__ = ["ROUTES", "messages", "count_tokens"]

SSE = "text/event-stream"
_OPT = {"dialect": am.NAME}


@post("/v1/messages", opt=_OPT, status_code=200)
async def messages(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    body = await decode_body(request, am.MessagesRequest)
    req = am.to_generation_request(body)
    if ctx.respond_async:  # llmq's extension: 202 and a job to poll at /v1/jobs/{id}
        return await accepted(svc, ctx, req)
    stream = bool(body.stream)
    sub = await submit(svc, ctx, req, keepalive=stream)
    if not stream:
        result = await collect(sub.events)
        return json_response(am.render_result(sub.request, result, sub.job_id, sub.created))
    return event_stream(sub.events, lambda events: am.render_stream(sub.request, events, sub.job_id), SSE,
                        svc.settings.sse_keepalive_s)


@post("/v1/messages/count_tokens", opt=_OPT, status_code=200)
async def count_tokens(request: Request, svc: Svc) -> Response:
    """The prompt's tokens as the worker will render it: the same conversation (:func:`am.chat_of`)
    through the same chat template, so the count equals a create's ``usage.input_tokens``."""
    body = await decode_body(request, am.CountTokensRequest)
    chat, options = am.chat_of(body)
    model = await svc.models.resolve(body.model)  # an unknown model is a 404 here too
    if model != svc.models.default:  # the API holds one tokenizer: LLMQ_MODEL's
        raise TokenizerUnavailable(f"No tokenizer for `{model}` here: count_tokens serves `{svc.models.default}`")
    ids = await svc.tokenizer.chat_ids(chat, options)
    return json_response(am.TokenCount(input_tokens=len(ids)))


ROUTES = [messages, count_tokens]
