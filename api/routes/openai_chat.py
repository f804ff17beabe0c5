"""OpenAI chat completions: ``POST /v1/chat/completions``, and LMI's chat on ``/invocations``."""

from __future__ import annotations

from litestar import Request, Response, post

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import openai_chat as chat
from api.dialects.stream import SSE
from api.http import decode_body
from api.operations import (
    ASYNC,
    ASYNC_HEADERS,
    CHAT_EXAMPLE,
    JSON,
    OPENAI_ERROR,
    OPENAI_ERRORS,
    documented,
)
from api.services import Svc

__all__ = ["ROUTES", "chat_completions", "chat_response"]


async def chat_response(request: Request, svc: Svc, ctx: RequestContext, *, lmi: bool) -> Response:
    """A chat request, answered in OpenAI's shapes. ``lmi=True`` is LMI's chat on ``/invocations``:
    its stream is JSON lines of chunks unless LMI's output formatter is ``sse``."""
    body = await decode_body(request, chat.ChatRequest)
    req = chat.to_generation_request(body, max_model_len=svc.settings.max_model_len)
    sse_format = not lmi or svc.settings.lmi_output_formatter == "sse"
    return await jobs.respond(svc, ctx, req, stream=bool(body.stream),
                              renderer=lambda q: chat.ChatStream(q.request, q.job_id, q.created, sse_format=sse_format))


@documented("OpenAI chat completions", "openai", body="chat", examples=(CHAT_EXAMPLE,),
            ok={200: (JSON, SSE), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=chat.ChatCompletion,
            error=OPENAI_ERROR)
@post("/v1/chat/completions", opt={"dialect": chat.NAME}, status_code=200)
async def chat_completions(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await chat_response(request, svc, ctx, lmi=False)


ROUTES = [chat_completions]
