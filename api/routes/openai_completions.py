"""OpenAI completions: ``POST /v1/completions`` (a list of prompts fans out, one job each) and
``GET /v1/models``."""

from __future__ import annotations

from litestar import Request, Response, get, post

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import openai_completions as oc
from api.dialects.stream import SSE
from api.http import decode_body, json_response
from api.models import caller
from api.operations import ASYNC, ASYNC_HEADERS, JSON, OPENAI_ERROR, OPENAI_ERRORS, documented
from api.services import Svc
from shared.media import TEXT_ONLY, ModelInfo

__all__ = ["ROUTES", "completions", "models", "completions_response"]


async def completions_response(request: Request, svc: Svc, ctx: RequestContext) -> Response:
    body = await decode_body(request, oc.CompletionRequest)
    return await jobs.respond(svc, ctx, oc.to_generation_requests(body), stream=body.stream,
                              renderer=lambda q: oc.CompletionStream(q.requests, q.job_id, q.created))


@documented("OpenAI completions", "openai", body="completions",
            examples=({"prompt": "Hello", "max_tokens": 4}, {"prompt": ["a", "b"], "max_tokens": 2, "stream": True}),
            ok={200: (JSON, SSE), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=oc.Completion,
            error=OPENAI_ERROR)
@post("/v1/completions", opt={"dialect": oc.NAME}, status_code=200)
async def completions(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await completions_response(request, svc, ctx)


@documented("Models requests may name (served now, or queued for the next worker)", "openai",
            answer=oc.ModelList, error=OPENAI_ERROR)
@get("/v1/models", opt={"dialect": oc.NAME})
async def models(svc: Svc, ctx: Ctx) -> Response:
    """The models requests may name: served now, or queued for the next worker that serves them;
    ``max_model_len`` as their warm workers report it (api/models.py). Then the LoRA adapters the
    caller's key may use, each with its base model as ``parent``, as vLLM lists them; ``root`` is
    an adapter's source for operators, its name for anyone else (a path is the deployment's own)."""
    names = list(await svc.models.known())
    who = caller(svc, ctx)
    adapters = await svc.models.visible_adapters(who)
    bases = list(dict.fromkeys([*names, *(a.base for a in adapters)]))
    lengths = await svc.models.context_lengths(bases)
    infos: dict[str, ModelInfo] = {}
    for name in bases:  # one read of llmq:model-info for all of them (cached a second)
        info = await svc.media.infos.get(name) if svc.media is not None else None
        infos[name] = info or (ModelInfo(kind=svc.settings.kind) if name == svc.model else TEXT_ONLY)
    cards = [
        oc.Model(id=name, root=svc.settings.model if name == svc.model else name, max_model_len=lengths[name],
                 input_modalities=list(infos[name].input_modalities), kind=infos[name].kind)
        for name in names
    ]
    cards += [oc.Model(id=a.name, root=a.source if who.operator else a.name, parent=a.base,
                       max_model_len=lengths[a.base], input_modalities=list(infos[a.base].input_modalities),
                       kind=infos[a.base].kind) for a in adapters]
    return json_response(oc.ModelList(data=cards))


ROUTES = [completions, models]
