"""Rerank as vLLM's server speaks it at ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``: Jina's and
Cohere's shape (``query``, ``documents``, ``top_n``), one job whatever its documents.

A document is a string or ``{"text": ...}`` (Cohere's first API); the results are sorted by
``relevance_score`` (a cross-encoder's score of the (query, document) pair, through its sigmoid unless
``use_activation`` is false), best first, each with its ``index`` in ``documents`` and, unless
``return_documents`` is false (Cohere's, which defaults it off; vLLM always sends it), the document.
``top_n`` keeps the best ``top_n`` (0: all). Errors are OpenAI's (vLLM's statuses).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects import openai_completions
from api.dialects.common import ErrorResponse, refuse
from api.dialects.stream import unstreamed
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import GenerationRequest, JobResult, Pooling

__all__ = ["NAME", "RerankRequest", "RerankResponse", "to_generation_request", "render_result", "stream",
           "error_body", "ranked"]

NAME: Final = "rerank"


class Document(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: Annotated[int, Meta(ge=0)] = 0
    return_documents: bool = True
    use_activation: bool | None = None
    """vLLM's: false gives the model's raw score, not its sigmoid."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: a pair longer than the model takes is cut in its document (any value: to the model's context)."""
    max_tokens_per_doc: Annotated[int, Meta(ge=0)] = 0
    priority: int | None = None


class RankedDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    document: RankedDocument | UnsetType = UNSET
    relevance_score: float


class RerankUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def to_generation_request(body: RerankRequest) -> GenerationRequest:
    refuse(not body.documents, "'documents' must not be empty", "documents")
    refuse(body.max_tokens_per_doc > 0, "'max_tokens_per_doc' is not supported: use 'truncate_prompt_tokens'",
           "max_tokens_per_doc")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    pooling = Pooling(task="score", texts=texts, queries=[body.query], top_n=body.top_n,
                      return_text=body.return_documents, activation=body.use_activation is not False,
                      truncate=body.truncate_prompt_tokens is not None)
    return GenerationRequest(model=body.model or "", pooling=pooling, priority=body.priority, dialect=NAME)


def ranked(req: GenerationRequest, result: JobResult) -> list[tuple[int, float]]:
    """(index, score) of each document, best first, cut to ``top_n``: every ranking dialect's order
    (a stable sort: equal scores keep the documents' order)."""
    if result.pooled is None or req.pooling is None:
        raise InvalidRequest("this job made no scores")
    scores = sorted(((i, row[0]) for i, row in enumerate(result.pooled.rows())), key=lambda x: -x[1])
    return scores[:req.pooling.top_n] if req.pooling.top_n else scores


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> RerankResponse:
    assert req.pooling is not None
    texts = req.pooling.texts
    results = [RerankResult(index=i, relevance_score=score,
                            document=RankedDocument(text=texts[i]) if req.pooling.return_text else UNSET)
               for i, score in ranked(req, result)]
    tokens = result.usage.prompt_tokens
    return RerankResponse(id=f"rerank-{job_id}", model=req.served_name, results=results,
                          usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))


stream = unstreamed


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    return openai_completions.error_body(exc)
