"""OpenAI ``POST /v1/completions`` as vLLM's OpenAI server speaks it.

Streams are ``data: {chunk}\\n\\n`` ending with ``data: [DONE]\\n\\n``, also after an in-band
error. Errors are ``{"error": {"message", "type", "param", "code"}}`` with vLLM's statuses
(400 for validation, not FastAPI's 422).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from api.relay import KEEPALIVE, SSE_DONE, Keepalive, sse
from shared.errors import InvalidRequest, ServiceError, error_from_code
from shared.events import Done, Error, Event, TokenDelta
from shared.schemas import Choice, GenerationRequest, JobResult, OutputOptions, SamplingParams, TopLogprob

__all__ = ["CompletionRequest", "to_generation_request", "render_result", "render_stream", "error_body"]

NAME = "openai_completions"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class CompletionRequest(msgspec.Struct, kw_only=True):
    """OpenAI's fields plus vLLM's sampling extras. Unknown fields are accepted, as vLLM does."""

    model: str | None = None
    # str | list[int] | list[str] | list[list[int]]; msgspec allows one list type per union,
    # so the element types are checked in to_generation_request.
    prompt: str | list[int | str | list[int]]
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    suffix: str | None = None
    # vLLM extras
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0


def to_generation_request(body: CompletionRequest) -> GenerationRequest:
    if isinstance(body.prompt, list) and not all(isinstance(t, int) for t in body.prompt):
        raise InvalidRequest("a list of prompts is not supported yet; send one prompt per request", param="prompt")
    if body.echo:
        raise InvalidRequest("`echo` is not supported yet", param="echo")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    temperature = 1.0 if body.temperature is None else body.temperature
    if body.n > 1 and temperature == 0:
        raise InvalidRequest("n must be 1 when using greedy sampling, got " + str(body.n), param="n")
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stop):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    try:
        logit_bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from None
    prompt, prompt_ids = (body.prompt, None) if isinstance(body.prompt, str) else (None, body.prompt)
    if prompt_ids is not None and not prompt_ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    sampling = SamplingParams(
        n=body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=None if body.seed == -1 else body.seed,
        max_tokens=16 if body.max_tokens is None else body.max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=body.stop_token_ids or [],
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        logit_bias=logit_bias,
    )
    include_usage = body.stream_options.include_usage if body.stream_options else False
    return GenerationRequest(
        model=body.model or "",
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        output=OutputOptions(include_usage=include_usage),
        dialect=NAME,
        priority=body.priority,
    )


# --- rendering ------------------------------------------------------------------------------

def _logprobs(
    texts: list[str] | None, logprobs: list[float] | None, tops: list[list[TopLogprob]] | None, offset: int
) -> dict[str, Any] | None:
    if logprobs is None or texts is None:
        return None
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": logprobs,
        "tokens": texts,
        "top_logprobs": [{t.text: t.logprob for t in top} for top in tops] if tops else [{} for _ in texts],
    }


def _usage(result_usage) -> dict[str, int]:
    return {
        "prompt_tokens": result_usage.prompt_tokens,
        "completion_tokens": result_usage.completion_tokens,
        "total_tokens": result_usage.prompt_tokens + result_usage.completion_tokens,
    }


def _choice(c: Choice) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": _logprobs(c.token_texts, c.logprobs, c.top_logprobs, 0),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{job_id}",
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [_choice(c) for c in result.choices],
        "usage": _usage(result.usage),
    }


async def render_stream(
    req: GenerationRequest, events: AsyncIterator[Event | Keepalive], job_id: str, created: int
) -> AsyncIterator[bytes]:
    head = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": req.model}
    offsets: dict[int, int] = {}

    def chunk_choice(d: TokenDelta) -> dict[str, Any]:
        offset = offsets.get(d.index, 0)
        offsets[d.index] = offset + len(d.text)
        return {
            "index": d.index,
            "text": d.text,
            "logprobs": _logprobs(d.token_texts, d.logprobs, d.top_logprobs, offset),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }

    try:
        async for event in events:
            if isinstance(event, Keepalive):
                yield KEEPALIVE
                continue
            if isinstance(event, Error):
                yield sse(error_body(error_from_code(event.code, event.message, event.status))[1])
                break
            for delta in event.deltas:
                yield sse({**head, "choices": [chunk_choice(delta)]})
            if isinstance(event, Done):
                if req.output.include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(event.usage)})
                break
    except ServiceError as exc:  # the relay itself failed (say, Redis went away mid-stream)
        yield sse(error_body(exc)[1])
    # The stream always ends with [DONE], even after an error: the openai SDK waits for it.
    yield SSE_DONE


_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_body(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    return exc.status, {
        "error": {
            "message": exc.message,
            "type": _TYPES.get(exc.status, "InternalServerError"),
            "param": exc.param,
            "code": exc.status,
        }
    }
