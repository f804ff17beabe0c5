"""OpenAI ``POST /v1/embeddings`` as vLLM's OpenAI server speaks it.

``input`` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's
four forms); ``encoding_format`` ``float`` (a JSON number per component, each a float32's exact
value) or ``base64`` (the float32 values' little-endian bytes: the openai SDK asks for it by default
and decodes it with numpy), ``dimensions`` for a model that takes it (a Matryoshka model), ``user``
kept with the job. One job per request, whatever its inputs: nothing streams, so ``stream`` is no
field here. Errors are OpenAI's (vLLM's statuses), as the completions dialect's.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from api.dialects import openai_completions
from api.dialects.common import ErrorResponse, refuse
from api.dialects.stream import unstreamed
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import GenerationRequest, JobResult, OutputOptions, Pooling, Reported

__all__ = ["NAME", "MAX_INPUTS", "EmbeddingRequest", "EmbeddingResponse", "PoolingUsage", "to_generation_request",
           "render_result", "stream", "error_body"]

NAME: Final = "openai_embeddings"
MAX_INPUTS: Final = 2048
"""OpenAI's limit on a request's inputs (its ``input`` array: "2048 dimensions or less")."""


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    model: str | None = None
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """vLLM's: an input longer than the model takes is cut (any value: to the model's context)."""
    priority: int | None = None
    """vLLM's extra: lower runs earlier."""


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class PoolingUsage(msgspec.Struct, kw_only=True):
    """vLLM's usage of a pooling answer (its ``UsageInfo``): the inputs' tokens, nothing generated."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


def _inputs(given: str | list[Any]) -> dict[str, Any]:
    """``input`` as a :class:`Pooling`'s ``texts`` or ``token_ids``, or the request's 400."""
    if isinstance(given, str):
        return {"texts": [given]}
    refuse(not given, "'input' must not be empty", "input")
    refuse(len(given) > MAX_INPUTS, f"'input' has {len(given)} items, more than {MAX_INPUTS}", "input")
    if all(isinstance(x, str) for x in given):
        return {"texts": given}
    if all(_token_id(x) for x in given):
        return {"token_ids": [given]}
    if all(isinstance(x, list) and x and all(_token_id(t) for t in x) for x in given):
        return {"token_ids": given}
    raise InvalidRequest("'input' must be a string, a list of strings, a list of token ids (non-negative "
                         "integers) or a list of non-empty lists of token ids", param="input")


def _token_id(x: object) -> bool:
    return type(x) is int and 0 <= x < 2**63


def to_generation_request(body: EmbeddingRequest) -> GenerationRequest:
    pooling = Pooling(task="embed", dimensions=body.dimensions, truncate=body.truncate_prompt_tokens is not None,
                      encoding=body.encoding_format, **_inputs(body.input))
    return GenerationRequest(model=body.model or "", pooling=pooling, priority=body.priority, dialect=NAME,
                             output=OutputOptions(reported=Reported(user=body.user) if body.user else None))


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> EmbeddingResponse:
    pooled = result.pooled
    if pooled is None or req.pooling is None:
        raise InvalidRequest("this job made no embeddings")
    data: list[Embedding] = []
    if req.pooling.encoding == "base64":
        data = [Embedding(index=i, embedding=base64.b64encode(pooled.row(i)).decode()) for i in range(pooled.count)]
    else:
        data = [Embedding(index=i, embedding=values) for i, values in enumerate(pooled.rows())]
    tokens = result.usage.prompt_tokens
    return EmbeddingResponse(id=f"embd-{job_id}", created=created, model=req.served_name, data=data,
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


stream = unstreamed


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    return openai_completions.error_body(exc)
