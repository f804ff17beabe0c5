"""NVIDIA Triton's generate extension as its vLLM backend speaks it (``specs/triton-generate-extension.md``).

``POST /v2/models/{model}[/versions/{v}]/generate`` and ``/generate_stream`` take
``{"id"?, "text_input", "parameters"?}``. As in Triton, every key (top level or inside
``parameters``) that names a model input becomes that input (``stream``,
``exclude_input_in_output``, ``return_*``, ``sampling_parameters``); every other key is a request
parameter, which the vLLM backend passes to vLLM's ``SamplingParams``. A ``sampling_parameters``
input (a JSON string) replaces the request parameters, as in the backend.

Quirks kept on purpose:
- without ``exclude_input_in_output``, a non-streamed ``text_output`` starts with the prompt;
  streaming with ``exclude_input_in_output: false`` is an error;
- ``generate_stream`` without ``stream: true`` sends one event with the whole answer;
- response keys are sorted (Triton builds them from a ``std::map``); one choice gives scalars,
  ``n`` > 1 gives arrays; ``finish_reason`` is ``"None"`` until the choice ends; ``logprobs`` is a
  JSON *string*; ``cumulative_logprob`` is a float32.

A body is read in two steps: :func:`read_body` sorts the decoded object's keys into the typed
:class:`GenerateRequest` (model inputs, scalar request parameters), then
:func:`to_generation_request` checks and translates it. Every response is a Struct.

Errors are ``{"error": "<message>"}`` with Triton's statuses; once a stream has started they are
``data: {"error": ...}`` events. There is no terminator and no keep-alive comment.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from typing import Final, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.happy_vllm import sampling_from_dict, to_sampling_params
from api.dialects.stream import StreamRenderer
from shared import json_input
from shared.errors import InvalidRequest, ServiceError
from shared.events import Done, TokenDelta, Tokens
from shared.framing import sse
from shared.schemas import Choice, GenerationRequest, JobResult, OutputOptions, PromptInfo, StructuredOutput, TopLogprob

__all__ = [
    "NAME",
    "RawBody",
    "GenerateRequest",
    "read_body",
    "Outputs",
    "to_generation_request",
    "GenerateResponse",
    "ErrorResponse",
    "ServerMetadataResponse",
    "ModelMetadataResponse",
    "render_response",
    "TritonStream",
    "stream",
    "render_result",
    "error_body",
]

T = TypeVar("T")

NAME: Final = "triton"
MODEL_VERSION = "1"

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
UNSUPPORTED_INPUTS = ("image", "embedding_request")
INPUTS = ("text_input", "sampling_parameters", *BOOL_INPUTS, *UNSUPPORTED_INPUTS)


class TensorMetadata(msgspec.Struct):
    """KServe v2's ``$metadata_tensor``."""

    name: str
    datatype: str
    shape: list[int]


class ServerMetadataResponse(msgspec.Struct, kw_only=True):
    """``GET /v2``."""

    name: str
    version: str
    extensions: list[str]


class ModelMetadataResponse(msgspec.Struct, kw_only=True):
    """``GET /v2/models/{model}[/versions/{v}]``."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


# The vLLM backend's model inputs and outputs, as its auto-completed model config declares them.
METADATA_INPUTS = [
    TensorMetadata("text_input", "BYTES", [1]),
    TensorMetadata("stream", "BOOL", [1]),
    TensorMetadata("sampling_parameters", "BYTES", [1]),
    *(TensorMetadata(name, "BOOL", [1]) for name in ("exclude_input_in_output", *RETURN_FLAGS)),
]
METADATA_OUTPUTS = [
    TensorMetadata("text_output", "BYTES", [-1]),
    TensorMetadata("finish_reason", "BYTES", [-1]),
    TensorMetadata("cumulative_logprob", "FP32", [-1]),
    TensorMetadata("logprobs", "BYTES", [-1]),
    TensorMetadata("num_input_tokens", "UINT32", [1]),
    TensorMetadata("num_output_tokens", "UINT32", [-1]),
]


class Outputs(msgspec.Struct, frozen=True, kw_only=True):
    """What one request asked to get back (Triton's extra output tensors), kept beside the job."""

    id: str | None = None
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    logprobs_asked: bool = False
    """``logprobs`` was a sampling parameter; without it the backend's ``logprobs`` output is "null"."""


class _Inputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The model inputs a request may set. A tensor of one element may be written as a 1-list."""

    text_input: str | list[str] | None = None
    sampling_parameters: str | list[str] | None = None
    stream: bool | list[bool] = False
    exclude_input_in_output: bool | list[bool] | None = None
    return_finish_reason: bool | list[bool] = False
    return_cumulative_logprob: bool | list[bool] = False
    return_logprobs: bool | list[bool] = False
    return_num_input_tokens: bool | list[bool] = False
    return_num_output_tokens: bool | list[bool] = False


class _Structured(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``StructuredOutputsParams`` (the backend builds it from a JSON string)."""

    json: str | dict[str, object] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """Accepted; engine-wide in vLLM 0.32 (LLMQ_COMPACT_JSON), so not per request."""


def _one(name: str, value: T | list[T]) -> T:
    """A scalar, or the only element of a one-element tensor."""
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise InvalidRequest(f"input '{name}' must hold exactly one element, got {len(value)}", param=name)
    return value[0]


RawBody = dict[str, object]
"""A body as decoded, before its keys are sorted: any JSON object. Triton takes any key (one that
names no model input is a request parameter), so the body cannot be a closed Struct."""

JSONScalar = str | int | float | bool
"""What a Triton request parameter may hold."""


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Triton's generate request, its keys sorted as Triton sorts them: the model inputs (at the top
    level or in ``parameters``) and the request parameters (every other key, scalars only), which
    the vLLM backend passes to ``SamplingParams``. An open set: vLLM's keywords are checked later,
    by :func:`sampling_from_dict`, which names every one it does not know."""

    id: str | None = None
    inputs: _Inputs
    parameters: dict[str, JSONScalar] = {}


def _split(body: RawBody) -> tuple[dict[str, object], dict[str, JSONScalar]]:
    """Top-level keys and ``parameters`` entries -> (model inputs, request parameters)."""
    params_obj = body.get("parameters", {})
    if not isinstance(params_obj, dict):
        raise InvalidRequest("Expected JSON object for keyword: 'parameters'", param="parameters")
    inputs: dict[str, object] = {}
    params: dict[str, JSONScalar] = {}
    top = ((k, v) for k, v in body.items() if k not in ("id", "parameters"))
    for key, value in (*top, *params_obj.items()):
        if key in UNSUPPORTED_INPUTS:
            raise InvalidRequest(f"input '{key}' is not supported by llmq", param=key)
        if key in inputs or key in params:
            raise InvalidRequest(f"'{key}' is given twice (at the top level and in 'parameters')", param=key)
        if key in INPUTS:
            inputs[key] = value
        elif isinstance(value, (str, int, float, bool)):
            params[key] = value
        else:  # null, an array or an object: Triton's request parameters are scalars only
            raise InvalidRequest(
                f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.", param=key
            )
    return inputs, params


def _structured(value: object) -> StructuredOutput:
    try:
        raw = json_input.loads(value) if isinstance(value, str) else value
        so = msgspec.convert(raw, _Structured)
        schema = json_input.loads(so.json) if isinstance(so.json, str) else so.json
        if schema is not None and not isinstance(schema, dict):
            raise ValueError("`json` must be a JSON Schema object")
        return StructuredOutput(
            json=schema,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
        )
    except (ValueError, msgspec.ValidationError) as exc:  # JSONDecodeError, or not exactly one kind
        raise InvalidRequest(f"Invalid structured_outputs: {exc}", param="structured_outputs") from None


def _sampling_dict(inputs: _Inputs, params: dict[str, JSONScalar]) -> dict[str, object]:
    if inputs.sampling_parameters is None:
        return dict(params)
    try:
        parsed = json_input.loads(_one("sampling_parameters", inputs.sampling_parameters))
    except ValueError as exc:
        raise InvalidRequest(
            f"input 'sampling_parameters' is not valid JSON: {exc}", param="sampling_parameters"
        ) from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("input 'sampling_parameters' must be a JSON object", param="sampling_parameters")
    return parsed


def read_body(body: RawBody) -> GenerateRequest:
    """A decoded JSON object -> its model inputs and request parameters, checked in Triton's order."""
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest("Unable to parse 'id'", param="id")
    raw_inputs, params = _split(body)
    try:
        inputs = msgspec.convert(raw_inputs, _Inputs)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Unable to parse inputs: {exc}") from None
    return GenerateRequest(id=request_id, inputs=inputs, parameters=params)


def to_generation_request(body: GenerateRequest, model: str) -> tuple[GenerationRequest, Outputs]:
    inputs, params, request_id = body.inputs, body.parameters, body.id
    if inputs.text_input is None:
        raise InvalidRequest(
            f"expected 1 inputs but got 0 inputs for model '{model}': missing required input 'text_input'",
            param="text_input",
        )
    flags = {name: bool(_one(name, getattr(inputs, name))) for name in BOOL_INPUTS if name != "exclude_input_in_output"}
    stream = flags.pop("stream")
    exclude = inputs.exclude_input_in_output
    # The backend's rule: prepend the prompt unless excluded; a stream excludes it by default.
    prepend = not _one("exclude_input_in_output", exclude) if exclude is not None else not stream
    if prepend and stream:
        raise InvalidRequest(
            "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.",
            param="exclude_input_in_output",
        )
    sampling_dict = _sampling_dict(inputs, params)
    # vLLM's Triton backend names a LoRA adapter in its parameters; here it is registered as a
    # model name (shared/adapters.py), resolved as any request's model is. The answer's
    # `model_name` stays the path's model, as Triton's does.
    lora_name = sampling_dict.pop("lora_name", None)
    if lora_name is not None and not isinstance(lora_name, str):
        raise InvalidRequest("`lora_name` must be a string", param="lora_name")
    structured = sampling_dict.pop("structured_outputs", None)
    p = sampling_from_dict(sampling_dict, extra_keys=("structured_outputs",))
    outputs = Outputs(
        id=request_id, stream=stream, prepend_input=prepend, logprobs_asked=p.logprobs is not None, **flags
    )
    sampling = to_sampling_params(p, _structured(structured) if structured is not None else None)
    if outputs.return_cumulative_logprob and sampling.logprobs is None:
        # The sum needs the sampled tokens' logprobs, which vLLM computes only when asked.
        sampling = msgspec.structs.replace(sampling, logprobs=0)
    req = GenerationRequest(
        model=lora_name or model,
        prompt=_one("text_input", inputs.text_input),
        sampling=sampling,
        # Every streamed response carries num_input_tokens: the worker reports the prompt first.
        output=OutputOptions(return_full_text=prepend, prompt_tokens=stream and outputs.return_num_input_tokens),
        dialect=NAME,
    )
    return req, outputs


# --- rendering ------------------------------------------------------------------------------


def _float32(x: float) -> float:
    """Triton sends the FP32 tensor's value, widened to double."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _logprobs_json(d: TokenDelta | Choice, asked: bool) -> str:
    """The backend's ``logprobs`` output: ``json.dumps`` of one ``{token_id: {logprob, rank,
    decoded_token}}`` per position, the sampled token first. llmq knows a sampled token's rank only
    when it is among the top alternatives; otherwise the rank is null."""
    if not asked or d.logprobs is None:
        return "null"
    positions = []
    for i, (token_id, logprob) in enumerate(zip(d.token_ids, d.logprobs, strict=False)):
        tops: list[TopLogprob] = d.top_logprobs[i] if d.top_logprobs else []
        ranks = {t.id: r for r, t in enumerate(tops, start=1)}
        text = d.token_texts[i] if d.token_texts else ""
        position = {str(token_id): {"logprob": logprob, "rank": ranks.get(token_id), "decoded_token": text}}
        for rank, top in enumerate(tops, start=1):
            position.setdefault(str(top.id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.text})
        positions.append(position)
    return json.dumps(positions)


def _per_choice(values: list[T]) -> T | list[T]:
    """One choice: a scalar (Triton strips one-element arrays); several: an array."""
    return values[0] if len(values) == 1 else values


class GenerateResponse(msgspec.Struct, kw_only=True):
    """Triton's generate response. Its keys are sorted (Triton builds the JSON from a
    ``std::map``), so the fields are in that order; the extra outputs are there only when asked
    for. One choice gives scalars, ``n`` > 1 arrays."""

    cumulative_logprob: float | list[float] | UnsetType = UNSET
    finish_reason: str | list[str] | UnsetType = UNSET
    id: str | UnsetType = UNSET
    logprobs: str | list[str] | UnsetType = UNSET
    model_name: str
    model_version: str
    num_input_tokens: int | UnsetType = UNSET
    num_output_tokens: int | list[int] | UnsetType = UNSET
    text_output: str | list[str]


class ErrorResponse(msgspec.Struct):
    """Triton's error object, as an HTTP body or a stream event."""

    error: str


def _response(
    model: str,
    opts: Outputs,
    parts: Iterable[TokenDelta | Choice],
    texts: list[str],
    cumulative: list[float],
    prompt_tokens: int,
) -> GenerateResponse:
    parts = list(parts)
    return GenerateResponse(
        model_name=model,
        model_version=MODEL_VERSION,
        text_output=_per_choice(texts),
        id=opts.id if opts.id is not None else UNSET,
        finish_reason=_per_choice([str(p.finish_reason) for p in parts]) if opts.return_finish_reason else UNSET,
        cumulative_logprob=_per_choice([_float32(c) for c in cumulative]) if opts.return_cumulative_logprob else UNSET,
        logprobs=_per_choice([_logprobs_json(p, opts.logprobs_asked) for p in parts])
        if opts.return_logprobs
        else UNSET,
        num_input_tokens=prompt_tokens if opts.return_num_input_tokens else UNSET,
        num_output_tokens=_per_choice([len(p.token_ids) for p in parts]) if opts.return_num_output_tokens else UNSET,
    )


def render_response(req: GenerationRequest, result: JobResult, opts: Outputs) -> GenerateResponse:
    """The one response of ``/generate`` (and of ``/generate_stream`` without ``stream: true``)."""
    prefix = (req.prompt or "") if opts.prepend_input else ""
    choices = result.choices or [Choice()]
    return _response(
        req.model,
        opts,
        choices,
        [prefix + c.text for c in choices],
        [sum(c.logprobs or ()) for c in choices],
        result.usage.prompt_tokens,
    )


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> GenerateResponse:
    """A finished job read back through ``GET /v1/jobs/{id}``: the request's extra outputs and
    ``id`` were not kept, so only the base response (with the prompt rule) is rebuilt."""
    return render_response(req, result, Outputs(prepend_input=req.output.return_full_text))


class TritonStream(StreamRenderer[bytes]):
    """One event per engine step with the new text of every choice; the connection closes after
    the last one. Keep-alive ticks are dropped: Triton sends no comments, and some clients (vLLM's
    benchmark, for one) parse every non-empty line as JSON."""

    def __init__(self, req: GenerationRequest, job_id: str = "", created: int = 0, *,
                 opts: Outputs | None = None) -> None:
        self.req = req
        self.opts = opts if opts is not None else Outputs(prepend_input=req.output.return_full_text)
        self.cumulative = [0.0] * req.sampling.n
        self.finished: list[str | None] = [None] * req.sampling.n
        self.prompt_tokens = 0

    def step(self, event: Tokens | Done) -> list[bytes]:
        self.prompt_tokens = _prompt_tokens(event.prompt, self.prompt_tokens)
        if not event.deltas:
            return []
        return [sse(_step(self.req, self.opts, event.deltas, self.cumulative, self.finished, self.prompt_tokens))]

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [sse(ErrorResponse(exc.message))]


def stream(req: GenerationRequest, job_id: str, created: int) -> TritonStream:
    return TritonStream(req, job_id, created)


def _prompt_tokens(prompt: PromptInfo | None, known: int) -> int:
    return len(prompt.token_ids) if prompt is not None else known


def _step(
    req: GenerationRequest,
    opts: Outputs,
    deltas: list[TokenDelta],
    cumulative: list[float],
    finished: list[str | None],
    prompt_tokens: int,
) -> GenerateResponse:
    """One streamed response: every choice, "" for those with nothing new in this step."""
    by_index = {d.index: d for d in deltas}
    parts = []
    for i in range(req.sampling.n):
        d = by_index.get(i) or TokenDelta(index=i, finish_reason=finished[i])
        cumulative[i] += sum(d.logprobs or ())
        finished[i] = d.finish_reason or finished[i]
        parts.append(d)
    return _response(req.model, opts, parts, [d.text for d in parts], cumulative, prompt_tokens)


# Triton's statuses: INVALID_ARG/UNKNOWN/CANCELLED -> 400, NOT_FOUND -> 404, INTERNAL -> 500,
# UNSUPPORTED -> 501, UNAVAILABLE -> 503 (Triton has no 429: an overload is UNAVAILABLE; nor 504: a
# request whose queue timeout expires is UNAVAILABLE "Request timeout expired").
_STATUSES = {401: 401, 403: 403, 404: 404, 405: 405, 413: 413, 429: 503, 501: 501, 503: 503, 504: 503}


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    status = _STATUSES.get(exc.status, 400 if exc.status < 500 else 500)
    return status, ErrorResponse(exc.message)
