"""AWS LMI / DJL Serving (``specs/lmi-inference-schema.md``): the request side and errors.

``POST /invocations`` and ``POST /predictions/{model}`` with ``{"inputs", "parameters", "stream"}``.
``inputs`` as a string is the rolling-batch schema; as a list, the dynamic-batch schema (one job
per input). Rendering lives in :mod:`api.dialects.lmi_render`. Three shapes share this module:

- ``lmi``: rolling batch; validation errors are 424 ``{"error", "code"}``;
- ``lmi_tgi``: ``OPTION_TGI_COMPAT``: TGI's shapes (array body, SSE, details on, ``logprob``/``special``);
- ``lmi_batch``: dynamic batch; errors are 424 ``{"code", "message", "error"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Final

import msgspec
from msgspec import Meta

from api.dialects.lmi_render import BatchError, Details, LmiStream, LmiToken, batch_error, render_result, stream
from api.dialects.openai_structured import StructuredOutputs, structured_output
from api.dialects.stream import StreamRenderer
from shared.errors import GenerationFailed, InternalError, InvalidRequest, ServiceError
from shared.schemas import DialectName, GenerationRequest, JobResult, OutputOptions, SamplingParams

if TYPE_CHECKING:
    from api.dialects import Body  # the package imports this module first

__all__ = [
    "NAME",
    "LmiParameters",
    "LmiRequest",
    "to_generation_requests",
    "render_result",
    "LmiStream",
    "stream",
    "error_body",
    "batch_error_body",
    "LmiError",
    "GenerationError",
    "FrontendError",
    "TGI_COMPAT",
    "DYNAMIC_BATCH",
]

NAME: Final = "lmi"


class LmiParameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """GenerationParameters: the common set plus the vLLM extras that map onto vLLM.
    Unknown keys are accepted and ignored, as LMI does."""

    do_sample: bool | None = None
    seed: int | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    max_new_tokens: Annotated[int, Meta(ge=1)] = 30
    details: bool | None = None
    """Default: off, on under TGI compatibility."""
    return_full_text: bool = False
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    decoder_input_details: bool = False
    top_n_tokens: Annotated[int, Meta(ge=0, le=20)] = 0
    # vLLM extras
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    n: Annotated[int, Meta(ge=1, le=32)] = 1
    best_of: Annotated[int, Meta(ge=1, le=32)] | None = None
    num_beams: Annotated[int, Meta(ge=1, le=32)] = 1
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos_token: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    """vLLM's constrained decoding, which LMI's vLLM path passes through to the engine."""


class LmiRequest(msgspec.Struct, kw_only=True):
    inputs: str | list[str]
    parameters: LmiParameters = msgspec.field(default_factory=LmiParameters)
    stream: bool = False
    adapters: str | None = None
    """LMI's LoRA field: the adapter (shared/adapters.py) that serves the request, as if named as its model."""


def _sampling(p: LmiParameters, stream: bool) -> SamplingParams:
    # LMI >= 0.32 infers sampling from the sampling parameters; an explicit do_sample wins.
    sampling_asked = any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    do_sample = p.do_sample if p.do_sample is not None else sampling_asked
    sequences = max(p.n, p.best_of or 1)
    if stream and (sequences > 1 or p.num_beams > 1):
        raise InvalidRequest("`n`, `best_of` and `num_beams` greater than 1 are not supported with streaming")
    if stream and p.decoder_input_details:
        raise InvalidRequest("`decoder_input_details` is not supported with streaming")
    if sequences > 1 and p.num_beams == 1 and not do_sample:
        raise InvalidRequest("`n` and `best_of` greater than 1 need sampling: set `do_sample` or a `temperature`")
    return SamplingParams(
        n=sequences if p.num_beams == 1 else 1,
        temperature=(1.0 if p.temperature is None else p.temperature) if do_sample else 0.0,
        top_p=(p.top_p or 1.0) if do_sample else 1.0,
        top_k=(p.top_k or 0) if do_sample else 0,
        min_p=p.min_p,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        max_tokens=p.max_new_tokens,
        stop=p.stop_sequences or [],
        stop_token_ids=p.stop_token_ids or [],
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos_token,
        # Every LMI token carries a log_prob and its own text: ask for the sampled token's logprob
        # (0) at least; top_n_tokens asks for that many alternatives.
        logprobs=max(p.logprobs or 0, p.top_n_tokens),
        prompt_logprobs=0 if p.decoder_input_details else p.prompt_logprobs,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        beam_width=p.num_beams,
        length_penalty=p.length_penalty,
        structured=structured_output(p.structured_outputs, None),
    )


def to_generation_requests(body: LmiRequest, *, model: str = "", tgi_compat: bool = False) -> list[GenerationRequest]:
    """One request per input: a string is rolling batch, a list is the dynamic-batch schema."""
    p = body.parameters
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    batch = isinstance(body.inputs, list)
    if batch and not inputs:
        raise InvalidRequest("`inputs` must not be an empty list")
    if batch and (max(p.n, p.best_of or 1) > 1 or p.num_beams > 1):
        raise InvalidRequest("`n`, `best_of` and `num_beams` need a single input, not a list")
    sampling = _sampling(p, body.stream)
    output = OutputOptions(
        details=p.details if p.details is not None else tgi_compat,
        return_full_text=p.return_full_text,
        prompt_tokens=p.decoder_input_details,
    )
    dialect = DYNAMIC_BATCH.NAME if batch else (TGI_COMPAT.NAME if tgi_compat else NAME)
    return [
        GenerationRequest(model=body.adapters or model, prompt=text, sampling=sampling, output=output,
                          dialect=dialect)
        for text in inputs
    ]


def to_generation_request(body: LmiRequest, *, model: str = "", tgi_compat: bool = False) -> GenerationRequest:
    (req,) = to_generation_requests(body, model=model, tgi_compat=tgi_compat)
    return req


# --- errors ---------------------------------------------------------------------------------

class LmiError(msgspec.Struct, kw_only=True):
    """A request LMI's handler rejected (424)."""

    error: str
    code: int


class GenerationError(msgspec.Struct, kw_only=True):
    """A failure during generation: the documented error-shaped result."""

    generated_text: str = ""
    error: str
    code: int
    details: Details[LmiToken]


class FrontendError(msgspec.Struct, kw_only=True):
    """DJL's frontend shape (unknown model, no capacity, queue down, ...)."""

    code: int
    type: str
    message: str


def error_body(exc: ServiceError) -> tuple[int, LmiError | GenerationError | FrontendError]:
    if isinstance(exc, InvalidRequest):
        return 424, LmiError(error=exc.message, code=424)
    if exc.status >= 500 and isinstance(exc, (GenerationFailed, InternalError)):
        details: Details = Details(finish_reason="error", generated_tokens=None, inputs=None, tokens=None)
        return exc.status, GenerationError(error=exc.message, code=exc.status, details=details)
    return exc.status, FrontendError(code=exc.status, type=exc.code, message=exc.message)


def batch_error_body(exc: ServiceError) -> tuple[int, BatchError | LmiError | GenerationError | FrontendError]:
    """The dynamic-batch handler's failure: 424 ``invoke handler failure`` with the detail."""
    if isinstance(exc, InvalidRequest) or exc.status == 500:
        return 424, batch_error(exc.message)
    return error_body(exc)


# The other two shapes, registered as dialects of their own so errors and stored results
# (GET /v1/jobs/{id}) render the way they were asked for.
@dataclass(frozen=True, slots=True)
class Shape:
    """One of LMI's other response shapes, a :class:`api.dialects.Dialect` of its own."""

    NAME: DialectName
    render_result: Callable[[GenerationRequest, JobResult, str, int], Body]
    stream: Callable[[GenerationRequest, str, int], StreamRenderer[bytes]]
    error_body: Callable[[ServiceError], tuple[int, msgspec.Struct]]


TGI_COMPAT = Shape(NAME="lmi_tgi", render_result=render_result, stream=stream, error_body=error_body)
DYNAMIC_BATCH = Shape(NAME="lmi_batch", render_result=render_result, stream=stream, error_body=batch_error_body)
