"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from litestar import Request, Response, post

from api import jobs
from api.context import Ctx
from api.dialects import anthropic_messages as am
from api.dialects.stream import SSE
from api.http import decode_body, json_response
from api.models import caller
from api.operations import ASYNC, ASYNC_HEADERS, JSON, documented
from api.services import Svc
from shared.errors import TokenizerUnavailable
from shared.schemas import GenerationRequest

__all__ = ["ROUTES", "messages", "count_tokens"]

_OPT = {"dialect": am.NAME}
_ERRORS = (400, 404, 424, 503, 504, 529)  # a full queue is Anthropic's 529 overloaded_error


@documented("Anthropic messages", "anthropic", body="messages",
            examples=({"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                      {"model": "tiny-llama", "max_tokens": 2, "stream": True, "system": "Be brief.",
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
            ok={200: (JSON, SSE), **ASYNC}, errors=_ERRORS, headers=ASYNC_HEADERS, answer=am.Message,
            error=am.ErrorResponse)
@post("/v1/messages", opt=_OPT, status_code=200)
async def messages(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """``Prefer: respond-async`` is llmq's extension: 202 and a job to poll at /v1/jobs/{id}."""
    body = await decode_body(request, am.MessagesRequest)
    return await jobs.respond(svc, ctx, am.to_generation_request(body), stream=bool(body.stream))


@documented("Anthropic: the prompt's tokens, as a create would count them", "anthropic", body="count_tokens",
            examples=({"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]},), queues=False,
            errors=(400, 404, 503), answer=am.TokenCount, error=am.ErrorResponse)
@post("/v1/messages/count_tokens", opt=_OPT, status_code=200)
async def count_tokens(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """The prompt's tokens as the worker will render it: the same conversation and tools
    (:func:`am.chat_of`) through the same chat template, so the count equals a create's
    ``usage.input_tokens``; each image is its template placeholder's place taken by the tokens
    admission estimates for it (exact for the Idefics3 family: docs/images.md)."""
    body = await decode_body(request, am.CountTokensRequest)
    chat, options, tools = am.chat_of(body)
    # An unknown model is a 404 here too, and so is a private adapter of another key's.
    model = await svc.models.resolve(body.model, caller(svc, ctx))
    if model != svc.models.default:  # the API holds one tokenizer: LLMQ_MODEL's
        raise TokenizerUnavailable(f"No tokenizer for `{model}` here: count_tokens serves `{svc.models.default}`")
    images = (await svc.media.measure(GenerationRequest(model=model, messages=chat))).images if svc.media else []
    ids = await svc.tokenizer.chat_ids(chat, options, tools)
    return json_response(am.TokenCount(input_tokens=len(ids) + sum(image.tokens - 1 for image in images)))


ROUTES = [messages, count_tokens]
