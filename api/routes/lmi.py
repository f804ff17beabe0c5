"""LMI / DJL Serving routes: ``/invocations`` (dispatching on the body keys: ``inputs`` is LMI's
schema, ``messages`` its chat schema, ``prompt`` OpenAI completions) and ``/predictions/{model}``."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, post
from litestar.params import FromPath

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import lmi
from api.dialects import openai_chat as chat
from api.dialects import openai_completions as oc
from api.dialects.lmi_render import BatchStream, render_batch_result
from api.dialects.stream import SSE
from api.errors import answered_in
from api.http import decode_body
from api.operations import ASYNC, ASYNC_HEADERS, CHAT_EXAMPLE, JSON, JSONLINES, TGI_EXAMPLE, documented
from api.routes.openai_chat import chat_response
from api.routes.openai_completions import completions_response
from api.services import Svc
from shared import json_input
from shared.errors import InvalidRequest

__all__ = ["ROUTES", "invocations", "predictions"]


class _BodyKeys(msgspec.Struct):
    """Which schema a body speaks, read without decoding the rest (LMI dispatches on keys)."""

    # An empty Raw (falsy) means the key is absent; Raw cannot sit in a union with None.
    inputs: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


_keys_decoder = msgspec.json.Decoder(_BodyKeys)
_ERRORS = (400, 404, 424, 429, 503, 504)
_OK = {200: (JSON, JSONLINES, SSE), **ASYNC}


async def _lmi_response(request: Request, svc: Svc, ctx: RequestContext, model: str = "") -> Response:
    body = await decode_body(request, lmi.LmiRequest)
    if isinstance(body.inputs, list):  # errors in the dynamic-batch shape from here on
        return await answered_in(lmi.DYNAMIC_BATCH.NAME, _lmi_jobs(svc, ctx, body, model))
    return await _lmi_jobs(svc, ctx, body, model)


async def _lmi_jobs(svc: Svc, ctx: RequestContext, body: lmi.LmiRequest, model: str) -> Response:
    tgi_compat = svc.settings.lmi_tgi_compat
    reqs = lmi.to_generation_requests(body, model=model, tgi_compat=tgi_compat)
    if isinstance(body.inputs, list):  # dynamic batch: one job per input, answered together
        return await jobs.respond(svc, ctx, reqs, stream=body.stream,
                                  whole=lambda q, results: render_batch_result(results),
                                  renderer=lambda q: BatchStream(len(q.requests)))
    # TGI compatibility streams SSE by default, as LMI does.
    sse_format = tgi_compat or svc.settings.lmi_output_formatter == "sse"
    return await jobs.respond(svc, ctx, reqs, stream=body.stream,
                              renderer=lambda q: lmi.LmiStream(q.request, sse_format=sse_format))


@documented("LMI: dispatches on `inputs` / `prompt` / `messages`", "lmi", body="invocations",
            examples=(TGI_EXAMPLE, {"prompt": "Hi", "max_tokens": 2}, CHAT_EXAMPLE), ok=_OK, errors=_ERRORS,
            headers=ASYNC_HEADERS)
@post("/invocations", opt={"dialect": lmi.NAME}, status_code=200)
async def invocations(request: Request, svc: Svc, ctx: Ctx) -> Response:
    try:
        keys = json_input.decode(await request.body(), _keys_decoder)
    except msgspec.DecodeError as exc:  # (ValidationError is one)
        raise InvalidRequest(f"Malformed JSON body: {exc}") from None
    # An OpenAI body (LMI's chat schema is OpenAI's) is answered, errors too, in OpenAI's shapes.
    if not keys.inputs and keys.prompt:
        return await answered_in(oc.NAME, completions_response(request, svc, ctx.as_dialect(oc.NAME)))
    if not keys.inputs and keys.messages:
        return await answered_in(chat.NAME, chat_response(request, svc, ctx.as_dialect(chat.NAME), lmi=True))
    return await _lmi_response(request, svc, ctx)


@documented("LMI: a named model", "lmi", body="lmi",
            examples=({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}, "stream": True},), ok=_OK,
            errors=_ERRORS, headers=ASYNC_HEADERS, error=lmi.LmiError | lmi.GenerationError | lmi.FrontendError)
@post("/predictions/{model:str}", opt={"dialect": lmi.NAME}, status_code=200)
async def predictions(request: Request, svc: Svc, ctx: Ctx, model: FromPath[str]) -> Response:
    return await _lmi_response(request, svc, ctx, model=model)


ROUTES = [invocations, predictions]
