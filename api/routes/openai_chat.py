"""OpenAI chat completions: ``POST /v1/chat/completions``, and LMI's chat on ``/invocations``."""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.response import Stream

from api.context import Ctx, RequestContext
from api.dialects import openai_chat as chat
from api.http import accepted, decode_body, event_stream, json_response
from api.relay import collect
from api.services import Svc
from api.submit import submit

__all__ = ["ROUTES", "chat_completions", "chat_response"]

SSE = "text/event-stream"
JSONLINES = "application/jsonlines"


async def chat_response(request: Request, svc: Svc, ctx: RequestContext, *, lmi: bool) -> Response | Stream:
    """A chat request, answered in OpenAI's shapes. ``lmi=True`` is LMI's chat on ``/invocations``:
    its stream is JSON lines of chunks unless LMI's output formatter is ``sse``."""
    body = await decode_body(request, chat.ChatRequest)
    req = chat.to_generation_request(body, max_model_len=svc.settings.max_model_len)
    if ctx.respond_async:
        return await accepted(svc, ctx, req)
    sse_format = not lmi or svc.settings.lmi_output_formatter == "sse"
    stream = bool(body.stream)
    # Keep-alive comments only where the framing has comments: SSE, not JSON lines.
    sub = await submit(svc, ctx, req, keepalive=stream and sse_format)
    req = sub.request
    if not stream:
        result = await collect(sub.events)
        return json_response(chat.render_result(req, result, sub.job_id, sub.created))
    return event_stream(sub.events,
                        lambda events: chat.render_stream(req, events, sub.job_id, sub.created, sse_format=sse_format),
                        SSE if sse_format else JSONLINES, svc.settings.sse_keepalive_s)


@post("/v1/chat/completions", opt={"dialect": chat.NAME}, status_code=200)
async def chat_completions(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    return await chat_response(request, svc, ctx, lmi=False)


ROUTES = [chat_completions]
