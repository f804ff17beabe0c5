"""OpenAI-compatible routes: ``/v1/completions`` and ``/v1/models``."""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.response import Stream

from api.dialects import openai_completions as oc
from api.http import accepted, decode_body, idempotency_key, json_response, stream_response, wants_async
from api.relay import collect, prefetch
from api.services import Svc
from api.submit import submit

__all__ = ["completions", "models", "completions_response"]


async def completions_response(request: Request, svc: Svc) -> Response | Stream:
    body = await decode_body(request, oc.CompletionRequest)
    req = oc.to_generation_request(body)
    if wants_async(request):
        return await accepted(svc, request, req)
    sub = await submit(svc, req, idempotency_key=idempotency_key(request), keepalive=body.stream)
    req = sub.request
    if not body.stream:
        result = await collect(sub.events)
        return json_response(oc.render_result(req, result, sub.job_id, sub.created))
    events = await prefetch(sub.events, svc.settings.sse_keepalive_s)
    return stream_response(oc.render_stream(req, events, sub.job_id, sub.created), "text/event-stream")


@post("/v1/completions", opt={"dialect": "openai_completions"}, status_code=200)
async def completions(request: Request, svc: Svc) -> Response | Stream:
    return await completions_response(request, svc)


@get("/v1/models", opt={"dialect": "openai_completions"})
async def models(svc: Svc) -> Response:
    """The models a warm worker serves right now."""
    cards = [
        {"id": name, "object": "model", "created": 0, "owned_by": "llmq",
         "root": svc.settings.model if name == svc.model else name, "parent": None,
         "max_model_len": svc.settings.max_model_len}
        for name in await svc.models.live()
    ]
    return json_response({"object": "list", "data": cards})
