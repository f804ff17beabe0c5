"""AWS LMI / DJL Serving, rolling-batch schema (``specs/lmi-inference-schema.md``).

``POST /invocations`` and ``POST /predictions/{model}`` with ``{"inputs", "parameters", "stream"}``.
Streams are JSON lines by default, SSE when configured; only the last line carries
``generated_text`` (and ``details``). Validation errors are ``{"error": ..., "code": 424}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from api.relay import Keepalive, jsonline, sse
from shared.errors import InvalidRequest, ServiceError
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.schemas import Choice, GenerationRequest, JobResult, OutputOptions, SamplingParams

__all__ = ["LmiParameters", "LmiRequest", "to_generation_request", "render_result", "render_stream", "error_body"]

NAME = "lmi"


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
    details: bool = False
    return_full_text: bool = False
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    decoder_input_details: bool = False
    # vLLM extras
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    n: Annotated[int, Meta(ge=1)] = 1
    best_of: Annotated[int, Meta(ge=1)] = 1
    num_beams: Annotated[int, Meta(ge=1)] = 1
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos_token: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class LmiRequest(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: LmiParameters = msgspec.field(default_factory=LmiParameters)
    stream: bool = False


def to_generation_request(body: LmiRequest, model: str = "") -> GenerationRequest:
    p = body.parameters
    if p.n > 1 or p.best_of > 1 or p.num_beams > 1:
        raise InvalidRequest("`n`, `best_of` and `num_beams` greater than 1 are not supported yet")
    if p.decoder_input_details:
        raise InvalidRequest("`decoder_input_details` is not supported yet")
    # LMI >= 0.32 infers sampling from the sampling parameters; an explicit do_sample wins.
    sampling_asked = any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    do_sample = p.do_sample if p.do_sample is not None else sampling_asked
    sampling = SamplingParams(
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
        # Every LMI token line has a log_prob and its own text: ask for the sampled token's
        # logprob (0) at least.
        logprobs=p.logprobs or 0,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
    )
    return GenerationRequest(
        model=model,
        prompt=body.inputs,
        sampling=sampling,
        output=OutputOptions(details=p.details, return_full_text=p.return_full_text),
        dialect=NAME,
    )


# --- rendering ------------------------------------------------------------------------------

def _finish_reason(choice_reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's vocabulary to LMI's documented one: length | eos_token | stop_sequence."""
    if choice_reason == "length":
        return "length"
    if choice_reason == "stop":
        return "eos_token" if stop_reason is None else "stop_sequence"
    return choice_reason or "error"


def _tokens(ids: list[int], texts: list[str] | None, logprobs: list[float] | None) -> list[dict[str, Any]]:
    return [
        {"id": tid, "text": texts[i] if texts else "", "log_prob": logprobs[i] if logprobs else None}
        for i, tid in enumerate(ids)
    ]


def _generated_text(req: GenerationRequest, text: str) -> str:
    return (req.prompt or "") + text if req.output.return_full_text else text


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> dict[str, Any]:
    choice = result.choices[0] if result.choices else Choice()
    body: dict[str, Any] = {"generated_text": _generated_text(req, choice.text)}
    if req.output.details:
        body["details"] = {
            "finish_reason": _finish_reason(choice.finish_reason, choice.stop_reason),
            "generated_tokens": len(choice.token_ids),
            "inputs": req.prompt,
            "tokens": _tokens(choice.token_ids, choice.token_texts, choice.logprobs),
        }
    return body


def _delta_lines(delta: TokenDelta) -> list[dict[str, Any]]:
    """One line per token. The text is the incremental detokeniser's, not each token decoded
    alone, so the lines always add up to ``generated_text`` even when a character spans several
    byte-level tokens; when one delta holds several tokens its text rides on the last one."""
    texts = [""] * (len(delta.token_ids) - 1) + [delta.text]
    return [{"token": t} for t in _tokens(delta.token_ids, texts, delta.logprobs)]


_ERROR_LINE = {
    "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
}


async def render_stream(
    req: GenerationRequest, events: AsyncIterator[Event | Keepalive], *, sse_format: bool
) -> AsyncIterator[bytes]:
    def frame(obj: object) -> bytes:
        return sse(obj) if sse_format else jsonline(obj)

    try:
        async for line in _lines(req, events):
            yield frame(line)
    except ServiceError as exc:  # the relay itself failed (say, Redis went away mid-stream)
        yield frame({**_ERROR_LINE, "error": exc.message})


async def _lines(req: GenerationRequest, events: AsyncIterator[Event | Keepalive]) -> AsyncIterator[dict[str, Any]]:
    text_parts: list[str] = []
    generated = 0
    async for event in events:
        if isinstance(event, Keepalive):
            continue  # JSON lines has no comment syntax; SSE keep-alives are not LMI's either
        if isinstance(event, Error):
            yield {**_ERROR_LINE, "error": event.message}
            return
        assert isinstance(event, (Tokens, Done))
        lines = [line for delta in event.deltas for line in _delta_lines(delta)]
        for delta in event.deltas:
            text_parts.append(delta.text)
            generated += len(delta.token_ids)
        if isinstance(event, Tokens):
            for line in lines:
                yield line
            continue
        # The last line carries the last token plus generated_text (and details when asked).
        last = lines.pop() if lines else {"token": {"id": -1, "text": "", "log_prob": None, "special_token": True}}
        for line in lines:
            yield line
        last["generated_text"] = _generated_text(req, "".join(text_parts))
        if req.output.details:
            final = event.deltas[-1] if event.deltas else TokenDelta()
            last["details"] = {
                "finish_reason": _finish_reason(final.finish_reason, final.stop_reason),
                "generated_tokens": generated,
                "inputs": req.prompt,
            }
        yield last
        return


def error_body(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, InvalidRequest):
        return 424, {"error": exc.message, "code": 424}
    if exc.status >= 500 and exc.code in ("generation_failed", "internal_error"):
        # A failure during generation: the documented error-shaped result, with the real status.
        return exc.status, {
            "generated_text": "",
            "error": exc.message,
            "code": exc.status,
            "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None},
        }
    return exc.status, {"code": exc.status, "type": exc.code, "message": exc.message}
