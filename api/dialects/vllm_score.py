"""vLLM's ``POST /score`` (and ``/v1/score``): a cross-encoder's score of text pairs, one job per request.

The pairs come as ``text_1``/``text_2``, or under vLLM's other names for the same two sides
(``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``). Each side is a string or a
list; the first has one text (scored against every text of the second) or as many as the second
(scored pairwise), as vLLM allows. ``data`` answers each pair in order (``index``, ``score``).
Errors are OpenAI's (vLLM's statuses).
"""

from __future__ import annotations

from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects import openai_completions
from api.dialects.common import ErrorResponse, refuse
from api.dialects.openai_embeddings import PoolingUsage
from api.dialects.stream import unstreamed
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import GenerationRequest, JobResult, Pooling

__all__ = ["NAME", "ScoreRequest", "ScoreResponse", "to_generation_request", "render_result", "stream",
           "error_body"]

NAME: Final = "vllm_score"

Side = str | list[str]
# vLLM's names for the two sides of its pairs, the first pair its own original.
_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    model: str | None = None
    text_1: Side | UnsetType = UNSET
    text_2: Side | UnsetType = UNSET
    queries: Side | UnsetType = UNSET
    documents: Side | UnsetType = UNSET
    items: Side | UnsetType = UNSET
    data_1: Side | UnsetType = UNSET
    data_2: Side | UnsetType = UNSET
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = None


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


def _sides(body: ScoreRequest) -> tuple[list[str], list[str]]:
    for first, second in _SIDES:
        one, two = getattr(body, first), getattr(body, second)
        if one is not UNSET and two is not UNSET:
            return ([one] if isinstance(one, str) else one), ([two] if isinstance(two, str) else two)
    raise InvalidRequest("a score request takes its pairs as 'text_1' and 'text_2' (or 'queries' and 'documents', "
                         "'queries' and 'items', 'data_1' and 'data_2')", param="text_1")


def to_generation_request(body: ScoreRequest) -> GenerationRequest:
    queries, texts = _sides(body)
    refuse(not queries or not texts, "neither side of a score request may be empty", "text_2")
    refuse(len(queries) not in (1, len(texts)),
           f"the first side must have one text or as many as the second: got {len(queries)} and {len(texts)}",
           "text_1")
    pooling = Pooling(task="score", texts=texts, queries=queries, activation=body.use_activation is not False,
                      truncate=body.truncate_prompt_tokens is not None)
    return GenerationRequest(model=body.model or "", pooling=pooling, priority=body.priority, dialect=NAME)


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> ScoreResponse:
    if result.pooled is None:
        raise InvalidRequest("this job made no scores")
    tokens = result.usage.prompt_tokens
    return ScoreResponse(id=f"score-{job_id}", created=created, model=req.served_name,
                         data=[ScoreData(index=i, score=row[0]) for i, row in enumerate(result.pooled.rows())],
                         usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


stream = unstreamed


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    return openai_completions.error_body(exc)
