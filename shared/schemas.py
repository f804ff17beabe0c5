"""The internal request every dialect translates into, and the job record kept in Redis.

New fields always get defaults, so API and workers of different versions can share a queue.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "SamplingParams",
    "OutputOptions",
    "GenerationRequest",
    "Choice",
    "TopLogprob",
    "Usage",
    "JobResult",
    "JobError",
    "JobStatus",
    "JobRecord",
    "TERMINAL_STATUSES",
]

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL_STATUSES = frozenset({"done", "failed", "cancelled"})


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling as vLLM understands it; the ranges are vLLM's own (``SamplingParams._verify_args``).

    Dialects validate with their own rules and messages first; these bounds guard the internal
    ``POST /v1/jobs`` shape and anything a dialect forgot.
    """

    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # 0 and -1 both disable top-k
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: int | None = None
    max_tokens: Annotated[int, Meta(ge=1)] = 16
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Top-k logprobs per generated token; 0 = only the sampled token's logprob."""
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] = {}


class OutputOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the submitting dialect wants the result rendered (also for ``GET /v1/jobs/{id}``)."""

    details: bool = False
    return_full_text: bool = False
    echo: bool = False
    include_usage: bool = False


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One generation job, whatever wire dialect it arrived in."""

    model: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    dialect: str = "jobs"
    """Which dialect renders the result: ``jobs``, ``lmi``, ``openai_completions``, ..."""
    priority: int = 0

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of `prompt` or `prompt_token_ids` is required")


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One alternative token: compact on the wire as ``[id, text, logprob]``."""

    id: int
    text: str
    logprob: float


class Choice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generated sequence, accumulated from token events."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    token_texts: list[str] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None
    """vLLM's vocabulary: ``stop``, ``length``, ``abort``; dialects translate."""
    stop_reason: str | int | None = None
    """The stop string or token id that matched; None when EOS ended the sequence."""


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class JobResult(msgspec.Struct, kw_only=True):
    choices: list[Choice] = []
    usage: Usage = msgspec.field(default_factory=Usage)


class JobError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    status: int = 500


class JobRecord(msgspec.Struct, kw_only=True):
    """The job hash ``llmq:{model}:job:<id>``, decoded. Timestamps are epoch milliseconds."""

    id: str
    model: str
    status: JobStatus = "queued"
    request: GenerationRequest
    queued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    worker: str = ""
    attempt: int = 0
    cancel: bool = False
    result: JobResult | None = None
    error: JobError | None = None
