"""OpenAI ``POST /v1/completions`` as vLLM's OpenAI server speaks it.

Streams are ``data: {chunk}\\n\\n`` ending with ``data: [DONE]\\n\\n``, also after an in-band
error. Errors are ``{"error": {"message", "type", "param", "code"}}`` with vLLM's statuses
(400 for validation, not FastAPI's 422).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects.common import ErrorObject, ErrorResponse
from api.dialects.openai_structured import ResponseFormat, StructuredOutputs, structured_output
from api.dialects.stream import SseKeepalive, StreamRenderer
from api.dialects.tiers import priority_of_tier
from api.dialects.vllm_extras import VllmExtras
from shared.errors import InvalidRequest, ServiceError
from shared.events import Done, TokenDelta, Tokens
from shared.framing import SSE_DONE, sse
from shared.schemas import (
    Choice,
    GenerationRequest,
    JobResult,
    OutputOptions,
    PromptInfo,
    TopLogprob,
    Usage,
)

__all__ = [
    "NAME",
    "CompletionRequest",
    "to_generation_requests",
    "render_result",
    "render_results",
    "CompletionStream",
    "stream",
    "error_body",
    "usage_body",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionUsage",
    "ErrorObject",
    "ErrorResponse",
    "Model",
    "ModelList",
]

NAME: Final = "openai_completions"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = True
    continuous_usage_stats: bool = False


# The docstring is the schema's description in /openapi.json: the vLLM extras are VllmExtras's.
class CompletionRequest(VllmExtras, kw_only=True):
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
    priority: int | None = None  # None: the X-LLMQ-Priority header, or 0
    # A priority level (api/dialects/tiers.py); ``priority`` wins. OpenAI's completion object has
    # no field to report it in.
    service_tier: str | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


MAX_PROMPTS = 256  # one job per prompt: a bound on what one request may queue


def _prompts(prompt: str | list) -> list[tuple[str | None, list[int] | None]]:
    """OpenAI's four prompt forms as (text, token ids) pairs, one per job."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [(None, list(prompt))]
    if all(isinstance(t, str) for t in prompt):
        return [(t, None) for t in prompt]
    if all(isinstance(t, list) and t and all(isinstance(i, int) for i in t) for t in prompt):
        return [(None, list(t)) for t in prompt]
    raise InvalidRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


def to_generation_requests(body: CompletionRequest) -> list[GenerationRequest]:
    """One GenerationRequest per prompt (a list of prompts is a batch)."""
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    for name in ("suffix", "use_beam_search", "prompt_logprobs"):
        if getattr(body, name) not in (None, False):
            raise InvalidRequest(f"`{name}` is not supported by this server", param=name)
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
    prompts = _prompts(body.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    sampling = body.sampling_params(
        n=body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=None if body.seed == -1 else body.seed,
        max_tokens=16 if body.max_tokens is None else body.max_tokens,
        stop=stop,
        logprobs=body.logprobs,
        # echo with logprobs scores the prompt too, as vLLM does
        prompt_logprobs=body.logprobs if body.echo else None,
        logit_bias=logit_bias,
        structured=structured_output(body.structured_outputs, body.response_format),
    )
    include_usage = body.stream_options.include_usage if body.stream_options else False
    output = OutputOptions(include_usage=include_usage, echo=body.echo, prompt_tokens=body.echo)
    return [
        GenerationRequest(
            model=body.model or "", prompt=text, prompt_token_ids=ids, sampling=sampling, output=output,
            dialect=NAME, priority=body.priority if body.priority is not None else priority_of_tier(body.service_tier),
        )
        for text, ids in prompts
    ]


# --- response objects -----------------------------------------------------------------------
# Named after OpenAI's API reference; field order is the order on the wire. A field that is
# sometimes absent is UnsetType (omitted), never None (which is an explicit null).


class CompletionUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy logprobs object: one entry per token, ``top_logprobs`` keyed by token text."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None  # vLLM's extra: the stop string or token id that ended the choice


class Completion(msgspec.Struct, kw_only=True):
    """A response, and also each chunk of a stream (as in OpenAI's API): a chunk has no ``usage``
    but the last one when usage was asked for, whose ``choices`` is empty."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | UnsetType = UNSET


class Model(msgspec.Struct, kw_only=True):
    """A ``/v1/models`` card, with vLLM's extras (``root``, ``parent``, ``max_model_len``)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "llmq"
    root: str
    parent: str | None = None
    max_model_len: int
    input_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    """What the model takes (llmq's, as OpenRouter names it): ``["text", "image"]`` for a model
    its workers serve with images (docs/images.md); ``["text"]`` otherwise, or while no worker
    has said."""
    kind: str = "generate"
    """What the model does (llmq's): ``generate``, ``embed`` (``/v1/embeddings``) or ``rerank``
    (a cross-encoder's scores), as its workers report it; LLMQ_MODEL's own until one has."""


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[Model]


# --- rendering ------------------------------------------------------------------------------

def _logprobs(
    texts: list[str] | None,
    logprobs: Sequence[float | None] | None,
    tops: list[list[TopLogprob]] | None,
    offset: int,
) -> CompletionLogprobs | None:
    """``logprobs``: a choice's floats, or with ``echo`` its prompt's first (None) and the rest."""
    if logprobs is None or texts is None:
        return None
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_dicts: list[dict[str, float] | None] = [
        None if lp is None else ({t.text: t.logprob for t in tops[i]} if tops else {})
        for i, lp in enumerate(logprobs)
    ]
    return CompletionLogprobs(text_offset=offsets, token_logprobs=list(logprobs), tokens=texts,
                              top_logprobs=top_dicts)


def usage_body(usage: Usage) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def _echo(req: GenerationRequest, prompt: PromptInfo | None, want_logprobs: bool):
    """The prompt as ``echo`` prints it: text, and its per-token logprobs when asked."""
    text = req.prompt if req.prompt is not None else "".join(prompt.token_texts if prompt else ())
    if not want_logprobs or prompt is None or prompt.logprobs is None:
        return text, None, None, None
    tops = prompt.top_logprobs or [[] for _ in prompt.logprobs]
    return text, list(prompt.token_texts), list(prompt.logprobs), list(tops)


def _with_echo(req, prompt, text, texts, logprobs, tops):
    """Prefix one choice's text (and logprobs) with its prompt."""
    e_text, e_texts, e_lps, e_tops = _echo(req, prompt, logprobs is not None)
    if e_lps is not None and logprobs is not None:
        texts = e_texts + list(texts or [])
        tops = e_tops + list(tops or [[] for _ in logprobs])
        logprobs = e_lps + list(logprobs)
    return e_text + text, texts, logprobs, tops


def _choice(c: Choice, req: GenerationRequest, prompt: PromptInfo | None, index: int) -> CompletionChoice:
    text, texts, logprobs, tops = c.text, c.token_texts, c.logprobs, c.top_logprobs
    if req.output.echo:
        text, texts, logprobs, tops = _with_echo(req, prompt, text, texts, logprobs, tops)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=_logprobs(texts, logprobs, tops, 0),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def render_results(
    reqs: list[GenerationRequest], results: list[JobResult], job_id: str, created: int
) -> Completion:
    """A batch of prompts as one completion: choice indexes run across the prompts."""
    n = reqs[0].sampling.n
    choices = [
        _choice(c, req, result.prompt, j * n + c.index)
        for j, (req, result) in enumerate(zip(reqs, results, strict=True))
        for c in result.choices
    ]
    usage = Usage(
        prompt_tokens=sum(r.usage.prompt_tokens for r in results),
        completion_tokens=sum(r.usage.completion_tokens for r in results),
    )
    return Completion(
        id=f"cmpl-{job_id}", created=created, model=reqs[0].served_name, choices=choices, usage=usage_body(usage)
    )


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Completion:
    return render_results([req], [result], job_id, created)


class CompletionStream(SseKeepalive, StreamRenderer[bytes]):
    """Chunks as vLLM streams them, ending with ``[DONE]`` (also after an error: the openai SDK
    waits for it). The events are one job's, or several merged by api.fanout."""

    def __init__(self, reqs: list[GenerationRequest] | GenerationRequest, job_id: str, created: int) -> None:
        self.reqs = reqs if isinstance(reqs, list) else [reqs]
        self.first = self.reqs[0]
        self.n = self.first.sampling.n
        self.model = self.first.served_name  # read once, not per chunk
        self.job_id, self.created = job_id, created
        self.offsets: dict[int, int] = {}
        self.prompts: dict[int, PromptInfo] = {}

    def _chunk(self, choices: list[CompletionChoice], usage: CompletionUsage | UnsetType = UNSET) -> bytes:
        return sse(Completion(id=f"cmpl-{self.job_id}", created=self.created, model=self.model, choices=choices,
                              usage=usage))

    def _choice(self, d: TokenDelta) -> CompletionChoice:
        text, texts, logprobs, tops = d.text, d.token_texts, d.logprobs, d.top_logprobs
        if self.first.output.echo and d.index not in self.offsets:  # a choice's first chunk carries its prompt
            job = d.index // self.n
            text, texts, logprobs, tops = _with_echo(self.reqs[job], self.prompts.get(job), text, texts, logprobs,
                                                     tops)
        offset = self.offsets.get(d.index, 0)
        self.offsets[d.index] = offset + len(text)
        return CompletionChoice(
            index=d.index,
            text=text,
            logprobs=_logprobs(texts, logprobs, tops, offset),
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
        )

    def step(self, event: Tokens | Done) -> list[bytes]:
        if event.prompt is not None:
            self.prompts[event.deltas[0].index // self.n if event.deltas else 0] = event.prompt
        out = [self._chunk([self._choice(delta)]) for delta in event.deltas
               if delta.token_ids or delta.text or delta.finish_reason or delta.index not in self.offsets]
        if isinstance(event, Done) and self.first.output.include_usage:
            out.append(self._chunk([], usage_body(event.usage)))
        return out

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [sse(error_body(exc)[1])]

    def close(self) -> list[bytes]:
        return [SSE_DONE]


def stream(req: GenerationRequest, job_id: str, created: int) -> CompletionStream:
    return CompletionStream(req, job_id, created)


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          413: "BadRequestError", 424: "FailedDependencyError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    # vLLM puts the HTTP status in ``code``, not OpenAI's string code.
    error = ErrorObject(
        message=exc.message, type=_TYPES.get(exc.status, "InternalServerError"), param=exc.param, code=exc.status
    )
    return exc.status, ErrorResponse(error=error)
