"""OpenAI embeddings: ``POST /v1/embeddings``, one job whatever its inputs, for a model whose
workers embed (LLMQ_MODEL_KIND embed)."""

from __future__ import annotations

from litestar import Request, Response, post

from api import jobs
from api.context import Ctx
from api.dialects import openai_embeddings as oe
from api.http import decode_body
from api.operations import ASYNC, ASYNC_HEADERS, JSON, OPENAI_ERROR, OPENAI_ERRORS, documented
from api.services import Svc

__all__ = ["ROUTES", "embeddings"]


@documented("OpenAI embeddings", "openai", body="embeddings",
            examples=({"model": "tiny-embed", "input": "Hello"},
                      {"model": "tiny-embed", "input": ["a", "b"], "encoding_format": "base64"}),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=oe.EmbeddingResponse,
            error=OPENAI_ERROR)
@post("/v1/embeddings", opt={"dialect": oe.NAME}, status_code=200)
async def embeddings(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, oe.EmbeddingRequest)
    return await jobs.respond(svc, ctx, oe.to_generation_request(body), stream=False)


ROUTES = [embeddings]
