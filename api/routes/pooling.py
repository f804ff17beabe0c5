"""The pooling routes: embeddings, rerank and score, for models whose workers pool (LLMQ_MODEL_KIND
embed or rerank). OpenAI's ``/v1/embeddings``; Jina's and Cohere's rerank as vLLM serves it
(``/rerank``, ``/v1/rerank``, ``/v2/rerank``); vLLM's ``/score``; TEI's ``/embed`` and its ``/rerank``
(``POST /rerank`` is TEI's when the body has ``texts``, vLLM's when it has ``documents``). Each request
is one job whatever its inputs, answered whole (or fired and polled with ``Prefer: respond-async``).
A request that names no model goes to the deployment's model of that kind (api/submit.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, post
from msgspec import UNSET, UnsetType

from api import jobs
from api.body import decode
from api.context import Ctx, RequestContext
from api.dialects import openai_embeddings as oe
from api.dialects import rerank as rr
from api.dialects import tei
from api.dialects import vllm_score as vs
from api.errors import answered_in
from api.operations import ASYNC, ASYNC_HEADERS, JSON, OPENAI_ERROR, OPENAI_ERRORS, documented
from api.services import Services, Svc
from api.submit import default_of_kind
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest

__all__ = ["ROUTES", "embeddings", "rerank", "rerank_v1", "rerank_v2", "score", "score_v1", "tei_embed"]


async def _answer(svc: Services, ctx: RequestContext, req: GenerationRequest) -> Response:
    if not req.model:
        req = msgspec.structs.replace(req, model=await default_of_kind(svc, req.kind))
    return await jobs.respond(svc, ctx, req, stream=False)


@documented("OpenAI embeddings", "openai", body="embeddings",
            examples=({"model": "tiny-embed", "input": "Hello"},
                      {"model": "tiny-embed", "input": ["a", "b"], "encoding_format": "base64"}),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=oe.EmbeddingResponse,
            error=OPENAI_ERROR)
@post("/v1/embeddings", opt={"dialect": oe.NAME}, status_code=200)
async def embeddings(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _answer(svc, ctx, oe.to_generation_request(decode(oe.EmbeddingRequest, await request.body())))


async def _rerank(body: bytes, svc: Services, ctx: RequestContext) -> Response:
    return await _answer(svc, ctx, rr.to_generation_request(decode(rr.RerankRequest, body)))


class _Which(msgspec.Struct, forbid_unknown_fields=False):
    """Which rerank a ``POST /rerank`` body is: TEI's names its texts ``texts``, vLLM's ``documents``."""

    texts: Any | UnsetType = UNSET
    documents: Any | UnsetType = UNSET


@documented("Rerank documents: TEI's when the body has `texts`, vLLM's (Jina's, Cohere's) when it has `documents`",
            "pooling", body="rerank_any", examples=({"query": "capital?", "documents": ["Paris is", "Bananas are"]},
                                                {"query": "capital?", "texts": ["Paris is", "Bananas are"]}),
            ok={200: (JSON,), **ASYNC}, errors=(400, 404, 422, 424, 429, 503), headers=ASYNC_HEADERS,
            answer=rr.RerankResponse | list[tei.Rank], error=tei.ErrorResponse | OPENAI_ERROR)
@post("/rerank", opt={"dialect": tei.NAME}, status_code=200)
async def rerank(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await request.body()
    which = decode(_Which, body)  # a body that is no JSON object: TEI's 422, as one with neither field
    if which.documents is not UNSET and which.texts is UNSET:
        return await answered_in(rr.NAME, _rerank(body, svc, ctx.as_dialect(rr.NAME)))
    if which.texts is UNSET:
        raise InvalidRequest("missing field `texts`: a rerank body names its texts `texts` (TEI's) or "
                             "`documents` (vLLM's, Jina's, Cohere's)", param="texts")
    return await _answer(svc, ctx, tei.rerank_request(decode(tei.RerankRequest, body)))


@documented("Rerank documents (Jina's shape, as vLLM serves it)", "pooling", body="rerank",
            examples=({"query": "capital?", "documents": ["Paris is", "Bananas are"], "top_n": 1},),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=rr.RerankResponse,
            error=OPENAI_ERROR)
@post("/v1/rerank", opt={"dialect": rr.NAME}, status_code=200)
async def rerank_v1(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _rerank(await request.body(), svc, ctx)


@documented("Rerank documents (Cohere's v2 path, as vLLM serves it)", "pooling", body="rerank",
            examples=({"query": "capital?", "documents": ["Paris is", "Bananas are"], "return_documents": False},),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=rr.RerankResponse,
            error=OPENAI_ERROR)
@post("/v2/rerank", opt={"dialect": rr.NAME}, status_code=200)
async def rerank_v2(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _rerank(await request.body(), svc, ctx)


async def _score(request: Request, svc: Services, ctx: RequestContext) -> Response:
    return await _answer(svc, ctx, vs.to_generation_request(decode(vs.ScoreRequest, await request.body())))


@documented("Score text pairs with a cross-encoder (vLLM's)", "pooling", body="score",
            examples=({"text_1": "capital?", "text_2": ["Paris is", "Bananas are"]},),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=vs.ScoreResponse,
            error=OPENAI_ERROR)
@post("/score", opt={"dialect": vs.NAME}, status_code=200)
async def score(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _score(request, svc, ctx)


@documented("Score text pairs (vLLM's older path)", "pooling", body="score",
            examples=({"text_1": ["a", "b"], "text_2": ["c", "d"]},),
            ok={200: (JSON,), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=vs.ScoreResponse,
            error=OPENAI_ERROR)
@post("/v1/score", opt={"dialect": vs.NAME}, status_code=200)
async def score_v1(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _score(request, svc, ctx)


@documented("Embed texts (TEI's)", "pooling", body="tei_embed",
            examples=({"inputs": "Hello"}, {"inputs": ["a", "b"], "normalize": False}),
            ok={200: (JSON,), **ASYNC}, errors=(404, 422, 424, 429, 503), headers=ASYNC_HEADERS, answer=None,
            error=tei.ErrorResponse)
@post("/embed", opt={"dialect": tei.NAME}, status_code=200)
async def tei_embed(request: Request, svc: Svc, ctx: Ctx) -> Response:
    return await _answer(svc, ctx, tei.embed_request(decode(tei.EmbedRequest, await request.body())))


ROUTES = [embeddings, rerank, rerank_v1, rerank_v2, score, score_v1, tei_embed]
