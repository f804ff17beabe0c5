"""Hugging Face Text Embeddings Inference (TEI): ``POST /embed`` and ``POST /rerank`` with ``texts``.

``/embed`` takes ``inputs`` (a string or a list), ``normalize`` (default true), ``truncate`` and
``dimensions``, and answers a list of vectors, one per input. ``/rerank`` takes ``query`` and
``texts`` with ``raw_scores`` (the model's logit, not its sigmoid), ``return_text`` and ``truncate``,
and answers ``[{"index", "score", "text"?}]`` best first. As llmq's other single-model dialects do,
both take the deployment's model of that kind, or a ``model`` field (TEI serves one model).

Errors are TEI's ``{"error", "error_type"}``: a request llmq refuses is 422 ``validation`` (TEI
answers its own validation errors 413 and a body it cannot read 422: llmq cannot tell them apart, and
every TEI client raises on both), a model of the other kind 424 ``backend`` (TEI's "model is not a
re-ranker model"), 429 ``overloaded``, 503 ``unhealthy``, a failed job 424 ``backend``.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects.common import refuse
from api.dialects.rerank import ranked
from api.dialects.stream import unstreamed
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import GenerationRequest, JobResult, Pooling

__all__ = ["NAME", "MAX_BATCH", "EmbedRequest", "RerankRequest", "Rank", "ErrorResponse", "embed_request",
           "rerank_request", "render_result", "stream", "error_body"]

NAME: Final = "tei"
MAX_BATCH: Final = 2048
"""Inputs or texts of one request at most (TEI's ``--max-client-batch-size`` defaults to 32; llmq
queues one job for them all, so it takes OpenAI's embeddings limit)."""


class EmbedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    model: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    query: str
    texts: list[str]
    truncate: bool = False
    raw_scores: bool = False
    return_text: bool = False
    model: str | None = None


class Rank(msgspec.Struct, kw_only=True):
    index: int
    text: str | UnsetType = UNSET
    score: float


class ErrorResponse(msgspec.Struct):
    error: str
    error_type: str


def embed_request(body: EmbedRequest) -> GenerationRequest:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    refuse(not texts, "`inputs` cannot be empty", "inputs")
    refuse(len(texts) > MAX_BATCH, f"batch size {len(texts)} > maximum allowed batch size {MAX_BATCH}", "inputs")
    pooling = Pooling(task="embed", texts=texts, activation=body.normalize, truncate=body.truncate,
                      dimensions=body.dimensions)
    return GenerationRequest(model=body.model or "", pooling=pooling, dialect=NAME)


def rerank_request(body: RerankRequest) -> GenerationRequest:
    refuse(not body.texts, "`texts` cannot be empty", "texts")
    refuse(len(body.texts) > MAX_BATCH, f"batch size {len(body.texts)} > maximum allowed batch size {MAX_BATCH}",
           "texts")
    pooling = Pooling(task="score", texts=body.texts, queries=[body.query], activation=not body.raw_scores,
                      truncate=body.truncate, return_text=body.return_text)
    return GenerationRequest(model=body.model or "", pooling=pooling, dialect=NAME)


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> list:
    if req.pooling is None or result.pooled is None:
        raise InvalidRequest("this job made no embeddings or scores")
    if req.pooling.task == "embed":
        return result.pooled.rows()
    texts = req.pooling.texts
    return [Rank(index=i, score=score, text=texts[i] if req.pooling.return_text else UNSET)
            for i, score in ranked(req, result)]


stream = unstreamed


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    if exc.status == 400 and exc.param == "model":  # a model of the other kind (shared/schemas.py wrong_kind)
        return 424, ErrorResponse(exc.message, "backend")
    if exc.status in (400, 422):
        return 422, ErrorResponse(exc.message, "validation")
    if exc.status == 429:
        return 429, ErrorResponse(exc.message, "overloaded")
    if exc.status == 503:
        return 503, ErrorResponse(exc.message, "unhealthy")
    if exc.status >= 500 or exc.status == 424:
        return 424, ErrorResponse(exc.message, "backend")
    return exc.status, ErrorResponse(exc.message, exc.code)
