"""happy_vllm's legacy ``POST /v1/generate`` and ``/v1/generate_stream`` (``specs/happy-vllm-generate.md``).

The body is ``prompt`` + happy_vllm's keywords (``prompt_in_response``, ``response_pool``,
``json_format``, ``json_format_is_json_schema``) + any vLLM ``SamplingParams`` keyword. The answer
is ``{"responses", "finish_reasons", "usages", "prompt"?}`` with one entry per ``n``; an unfinished
reason is the *string* ``"None"``. The stream is NDJSON of that same object after every engine
step, with cumulative text, written by Python's ``json.dumps`` (``", "`` / ``": "`` separators).

A body is read in two steps: :func:`read_body` sorts the decoded object's keys into the typed
:class:`RequestGenerate`, then :func:`to_generation_request` translates it. Every response is a
Struct.

Errors: happy_vllm answered incompatible keywords with a 500 (its middleware turned ValueError
into ``{"error", "messages"}``) and malformed bodies with FastAPI's 422 ``{"detail": ...}``. llmq
never answers bad input with a 500, so every invalid request is 422 ``{"detail": "<message>"}``.

:class:`VllmSampling` (vLLM's own keyword names) is shared with the Triton dialect, whose vLLM
backend takes the same keywords in ``parameters``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects.stream import NDJSON, StreamRenderer
from api.dialects.vllm_extras import VllmExtras
from shared.errors import InvalidRequest, ServiceError
from shared.events import Done, Tokens
from shared.schemas import GenerationRequest, JobResult, OutputOptions, SamplingParams, StructuredOutput

__all__ = [
    "NAME",
    "VllmSampling",
    "sampling_from_dict",
    "HappyOptions",
    "RawBody",
    "RequestGenerate",
    "read_body",
    "to_generation_request",
    "ResponseGenerate",
    "ResponseInformation",
    "render_result",
    "GenerateStream",
    "stream",
    "error_body",
]

NAME: Final = "happy_vllm"


class VllmSampling(VllmExtras, kw_only=True, forbid_unknown_fields=True):
    """The vLLM ``SamplingParams`` keywords llmq can honour, with vLLM's names, defaults and ranges
    (its extras beyond OpenAI's are :class:`VllmExtras`'s, here with ``SamplingParams``'s own
    defaults rather than null)."""

    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: int | None = None
    max_tokens: Annotated[int, Meta(ge=1)] = 16
    stop: str | list[str] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None


# In vLLM's own order (its SamplingParams', which llmq's keeps), as the refusal lists them.
ACCEPTED_SAMPLING_KEYS = tuple(f for f in SamplingParams.__struct_fields__ if f in VllmSampling.__struct_fields__)


def sampling_from_dict(params: Mapping[str, object], *, extra_keys: tuple[str, ...] = ()) -> VllmSampling:
    """vLLM keywords -> :class:`VllmSampling`. Values are converted leniently (``"0.5"`` -> 0.5,
    ``"true"`` -> True), as pydantic (happy_vllm) and Triton's vLLM backend both do; a keyword
    llmq cannot honour is refused by name rather than silently dropped."""
    unknown = sorted(k for k in params if k not in VllmSampling.__struct_fields__)
    if unknown:
        accepted = ", ".join((*ACCEPTED_SAMPLING_KEYS, *extra_keys))
        raise InvalidRequest(
            f"Unsupported sampling parameter(s): {', '.join(unknown)}. llmq accepts these vLLM "
            f"SamplingParams keywords: {accepted}.",
            param=unknown[0],
        )
    try:
        sampling = msgspec.convert(params, VllmSampling, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid sampling parameter: {exc}") from None
    # Lenient conversion reads "inf" and "nan" as floats, which JSON cannot carry to the worker.
    for name in ACCEPTED_SAMPLING_KEYS:
        value = getattr(sampling, name)
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise InvalidRequest(f"Invalid sampling parameter: `{name}` must be a finite number", param=name)
    return sampling


def to_sampling_params(p: VllmSampling, structured: StructuredOutput | None = None) -> SamplingParams:
    stop = [p.stop] if isinstance(p.stop, str) else (p.stop or [])
    if any(not s for s in stop):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    if p.max_tokens < p.min_tokens:
        raise InvalidRequest(
            f"max_tokens must be greater than or equal to min_tokens={p.min_tokens}, got {p.max_tokens}.",
            param="max_tokens",
        )
    return p.sampling_params(
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed,
        max_tokens=p.max_tokens,
        stop=stop,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        logit_bias=p.logit_bias or {},
        allowed_token_ids=p.allowed_token_ids,
        structured=structured,
    )


# --- the request ----------------------------------------------------------------------------


class HappyOptions(msgspec.Struct, kw_only=True):
    """happy_vllm's own keywords; everything else in the body is a vLLM SamplingParams keyword."""

    prompt: str
    prompt_in_response: bool = False
    response_pool: list[str] | None = None
    json_format: dict[str, Any] | None = None
    json_format_is_json_schema: bool = False


RawBody = dict[str, object]
"""A body as decoded, before its keys are sorted: any JSON object (the keys happy_vllm does not
know are vLLM keywords, refused by name when llmq does not know them either, so the body cannot
be a closed Struct: msgspec would refuse an unknown key without naming them all)."""


class RequestGenerate(msgspec.Struct, frozen=True, kw_only=True):
    """A ``/v1/generate`` body, its keys sorted: happy_vllm's keywords and vLLM's sampling keywords."""

    options: HappyOptions
    sampling: VllmSampling
    pool_and_format: bool = False
    """Both ``response_pool`` and ``json_format`` were given, even null: happy_vllm refused the pair."""


_HAPPY_KEYS = frozenset(HappyOptions.__struct_fields__)
_SIMPLE_TYPES = ("string", "integer", "boolean", "number")


def simple_json_schema(json_format: dict[str, Any]) -> dict[str, Any]:
    """happy_vllm's "simple json" (``{"field": "string" | ["integer"] ...}``) as the JSON Schema
    it stood for, with happy_vllm's own checks and messages."""
    schema: dict[str, Any] = {"properties": {}, "required": [], "title": "simple_json", "type": "object"}
    for key, value in json_format.items():
        if isinstance(value, list):
            if len(value) != 1:
                raise InvalidRequest(
                    f"The value {value} corresponding to the keyword {key} appears to be a list not composed "
                    f"of a single element in {list(_SIMPLE_TYPES)}",
                    param="json_format",
                )
            if value[0] not in _SIMPLE_TYPES:
                raise InvalidRequest(
                    f"The value {value} corresponding to the keyword {key} is a list where the single element "
                    f"in not in {list(_SIMPLE_TYPES)}",
                    param="json_format",
                )
            schema["properties"][key] = {"type": "array", "items": {"type": value[0]}}
        elif value in _SIMPLE_TYPES:
            schema["properties"][key] = {"type": value}
        else:
            raise InvalidRequest(
                f"The value {value} corresponding to the keyword {key} is not in {list(_SIMPLE_TYPES)}",
                param="json_format",
            )
        schema["required"].append(key)
    return schema


def _structured(body: RequestGenerate) -> StructuredOutput | None:
    opts, min_tokens = body.options, body.sampling.min_tokens
    if body.pool_and_format:
        raise InvalidRequest("Two keywords are incompatible : response_pool and json_format")
    if opts.response_pool:  # an empty pool (or null) constrained nothing in happy_vllm
        if min_tokens > 0:
            raise InvalidRequest(
                f"min_tokens : {min_tokens} is incompatible with the `response_pool` keyword", param="min_tokens"
            )
        return StructuredOutput(choice=list(opts.response_pool))
    if opts.json_format:  # {} (or null) switched the JSON logits processor off
        schema = opts.json_format if opts.json_format_is_json_schema else simple_json_schema(opts.json_format)
        # lm-format-enforcer capped runs of whitespace; llmq's equivalent is engine-wide
        # (LLMQ_COMPACT_JSON, on for the tiny model), since vLLM has no per-request switch.
        return StructuredOutput(json=schema)
    return None


def read_body(body: RawBody) -> RequestGenerate:
    """A decoded JSON object -> its keywords, checked in happy_vllm's order (so the first problem
    found is the one reported)."""
    # null is "not given" (pydantic's Field(None)), except for the required prompt.
    happy = {k: v for k, v in body.items() if k in _HAPPY_KEYS and (v is not None or k == "prompt")}
    if "prompt" not in happy:
        raise InvalidRequest("field required: `prompt`", param="prompt")
    try:
        opts = msgspec.convert(happy, HappyOptions, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}") from None
    if "logits_processors" in body:
        raise InvalidRequest(
            "The keyword `logits_processors` is reserved by happy_vllm and cannot be used", param="logits_processors"
        )
    rest = {k: v for k, v in body.items() if k not in _HAPPY_KEYS}
    if "max_tokens" in rest and rest["max_tokens"] is None:
        raise InvalidRequest(
            "max_tokens=null (generate until the context is full) is not supported; give a number", param="max_tokens"
        )
    # null means "vLLM's default" for the optional keywords, as pydantic's Field(None) did.
    params = sampling_from_dict({k: v for k, v in rest.items() if v is not None})
    # happy_vllm refused the pair as soon as both keys were present, even empty.
    both = "response_pool" in body and "json_format" in body
    return RequestGenerate(options=opts, sampling=params, pool_and_format=both)


def to_generation_request(body: RequestGenerate, *, stream: bool) -> GenerationRequest:
    """The internal request. ``stream`` asks the worker for the prompt's tokens on the first
    event, because every streamed line carries ``usages.prompt_tokens``."""
    opts = body.options
    sampling = to_sampling_params(body.sampling, _structured(body))
    return GenerationRequest(
        prompt=opts.prompt,
        sampling=sampling,
        output=OutputOptions(echo=opts.prompt_in_response, prompt_tokens=stream),
        dialect=NAME,
    )


# --- rendering ------------------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseGenerate(msgspec.Struct, kw_only=True):
    """The answer, and each streamed line: one entry per ``n``; ``prompt`` only when asked for."""

    responses: list[str]
    finish_reasons: list[str]
    usages: list[Usage]
    prompt: str | None | UnsetType = UNSET


class ErrorDetail(msgspec.Struct):
    """FastAPI's error body, which happy_vllm answered bad input with."""

    detail: str


class ResponseLiveness(msgspec.Struct):
    alive: str = "ok"


class ResponseReadiness(msgspec.Struct):
    ready: str


class ResponseInformation(msgspec.Struct, kw_only=True):
    """``GET /v1/info``."""

    application: str
    version: str
    vllm_version: str
    model_name: str
    truncation_side: str
    max_length: int


def _reason(reason: str | None) -> str:
    return "None" if reason is None else reason


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> ResponseGenerate:
    prompt_tokens = result.usage.prompt_tokens
    return ResponseGenerate(
        responses=[c.text for c in result.choices],
        finish_reasons=[_reason(c.finish_reason) for c in result.choices],
        usages=[_usage(prompt_tokens, len(c.token_ids)) for c in result.choices],
        prompt=req.prompt if req.output.echo else UNSET,
    )


def ndjson(obj: msgspec.Struct) -> bytes:
    """One stream line exactly as happy_vllm wrote it: ``json.dumps(ret) + "\\n"`` (spaces after
    ``,`` and ``:``, non-ASCII escaped), which is why this one is not ``shared.codec.encode``."""
    return (json.dumps(msgspec.to_builtins(obj)) + "\n").encode()


class GenerateStream(StreamRenderer[bytes]):
    """One line per engine step, each the whole answer so far. An error after the first line ends
    the stream with ``{"detail": ...}`` (happy_vllm just dropped the connection). NDJSON has no
    comment line, so quiet stretches send nothing."""

    media_type = NDJSON

    def __init__(self, req: GenerationRequest, job_id: str = "", created: int = 0) -> None:
        self.req = req
        n = req.sampling.n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.counts = [0] * n
        self.reasons: list[str | None] = [None] * n
        self.prompt_tokens = 0

    def step(self, event: Tokens | Done) -> list[bytes]:
        match event:
            case Tokens(prompt=prompt) if prompt is not None:
                self.prompt_tokens = len(prompt.token_ids)
            case Done(prompt=prompt):
                known = len(prompt.token_ids) if prompt is not None else self.prompt_tokens
                self.prompt_tokens = event.usage.prompt_tokens or known
        for d in event.deltas:
            self.texts[d.index].append(d.text)
            self.counts[d.index] += len(d.token_ids)
            self.reasons[d.index] = d.finish_reason or self.reasons[d.index]
        if not event.deltas:
            return []
        return [ndjson(ResponseGenerate(
            responses=["".join(t) for t in self.texts],
            finish_reasons=[_reason(r) for r in self.reasons],
            usages=[_usage(self.prompt_tokens, c) for c in self.counts],
            prompt=self.req.prompt if self.req.output.echo else UNSET,
        ))]

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [ndjson(ErrorDetail(exc.message))]


def stream(req: GenerationRequest, job_id: str, created: int) -> GenerateStream:
    return GenerateStream(req, job_id, created)


def error_body(exc: ServiceError) -> tuple[int, ErrorDetail]:
    """Bad input is FastAPI's 422 ``{"detail": ...}``; anything else keeps llmq's status."""
    status = 422 if exc.status == 400 else exc.status
    return status, ErrorDetail(exc.message)
