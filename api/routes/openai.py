"""OpenAI-compatible routes: ``/v1/completions`` and ``/v1/models``."""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.response import Stream

from api.context import Ctx, RequestContext
from api.dialects import openai_completions as oc
from api.fanout import collect_all, merge, submit_all
from api.http import accepted, decode_body, event_stream, json_response
from api.services import Svc

__all__ = ["completions", "models", "completions_response"]


async def completions_response(request: Request, svc: Svc, ctx: RequestContext) -> Response | Stream:
    body = await decode_body(request, oc.CompletionRequest)
    reqs = oc.to_generation_requests(body)
    if ctx.respond_async:
        return await accepted(svc, ctx, reqs)
    subs = await submit_all(svc, ctx, reqs, keepalive=body.stream)
    reqs = [sub.request for sub in subs]
    head = subs[0]
    if not body.stream:
        results = await collect_all(subs)
        return json_response(oc.render_results(reqs, results, head.job_id, head.created))
    return event_stream(merge(subs, body.n), lambda events: oc.render_stream(reqs, events, head.job_id, head.created),
                        "text/event-stream", svc.settings.sse_keepalive_s)


@post("/v1/completions", opt={"dialect": "openai_completions"}, status_code=200)
async def completions(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    return await completions_response(request, svc, ctx)


@get("/v1/models", opt={"dialect": "openai_completions"})
async def models(svc: Svc) -> Response:
    """The models requests may name: served now, or queued for the next worker that serves them."""
    cards = [
        oc.Model(id=name, root=svc.settings.model if name == svc.model else name,
                 max_model_len=svc.settings.max_model_len)
        for name in await svc.models.known()
    ]
    return json_response(oc.ModelList(data=cards))
