"""Hugging Face TGI's side coming in: ``/generate``, ``/generate_stream`` and ``/`` bodies, checked
as TGI's router checks them (``validation.rs``: its rules, its order and its messages), and their
translation. :mod:`api.dialects.tgi` is the dialect itself (answers, streams, errors).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from shared import json_input
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest, OutputOptions, SamplingParams, StructuredOutput

__all__ = ["NAME", "Grammar", "GenerateParameters", "GenerateRequest", "to_generation_request", "with_prompt_ids"]

NAME: Final = "tgi"
MAX_BEST_OF = 2
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
MAX_CLIENT_BATCH_SIZE = 4
DEFAULT_GENERATION_LENGTH = 1024  # TGI's cap when max_new_tokens is unset


class Grammar(msgspec.Struct):
    type: Literal["json", "json_object", "json_schema", "regex"]
    value: Any


class GenerateParameters(msgspec.Struct, kw_only=True):
    """TGI's GenerateParameters. Unknown keys are ignored, as TGI's serde does. Nulls are taken
    as "unset" (the huggingface_hub client drops them anyway)."""

    best_of: Annotated[int, Meta(ge=0)] | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool | None = None
    max_new_tokens: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    return_full_text: bool | None = None
    stop: list[str] | None = None
    truncate: Annotated[int, Meta(ge=0)] | None = None
    watermark: bool | None = None
    details: bool | None = None
    decoder_input_details: bool | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None
    top_n_tokens: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    grammar: Grammar | None = None
    adapter_id: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``/generate`` and ``/generate_stream`` bodies; ``/`` adds ``stream``. A missing
    ``parameters`` object means TGI's ``default_parameters()``, which samples."""

    inputs: str
    parameters: GenerateParameters | None = None
    stream: bool = False


def _range_checks(p: GenerateParameters, do_sample: bool, best_of: int) -> None:
    """validation.rs ``validate``, in its order."""
    if best_of > 1 and not (do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))):
        raise InvalidRequest("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0.0:
        raise InvalidRequest("`temperature` must be strictly positive")
    if p.temperature is not None and p.temperature > 2.0:  # vLLM's limit; TGI itself has none
        raise InvalidRequest("`temperature` must be <= 2.0")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0.0:
        raise InvalidRequest("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise InvalidRequest("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise InvalidRequest("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise InvalidRequest("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise InvalidRequest("`top_k` must be strictly positive")
    if p.max_new_tokens == 0:
        raise InvalidRequest("`max_new_tokens` must be strictly positive")
    if len(p.stop or ()) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop or ())}")
    if p.seed is not None and best_of > 1:
        raise InvalidRequest("`seed` must not be set when `best_of` > 1")
    if p.top_n_tokens is not None and p.top_n_tokens > MAX_TOP_N_TOKENS:
        raise InvalidRequest(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}")


def _limit_checks(inputs: str, p: GenerateParameters, max_total_tokens: int) -> None:
    if not inputs:
        raise InvalidRequest("`inputs` cannot be empty")
    max_input = max_total_tokens - 1
    if p.truncate is not None and (p.truncate == 0 or p.truncate > max_input):
        raise InvalidRequest(f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}")
    # Every input has at least one token; the exact input + max_new_tokens check needs the
    # prompt's length, which only the engine knows (it stops at the context length).
    if p.max_new_tokens is not None and p.max_new_tokens > max_input:
        raise InvalidRequest(f"`max_new_tokens` must be <= {max_input}. Given: {p.max_new_tokens}")
    # What vLLM cannot do is refused rather than silently ignored.
    if p.typical_p is not None:
        raise InvalidRequest("`typical_p` is not supported by this server (vLLM has no typical sampling)")
    if p.watermark:
        raise InvalidRequest("`watermark` is not supported by this server")


def _schema(value: Any) -> dict:
    """A JSON grammar's schema: an object, or a string holding one; TGI needs ``properties``."""
    if isinstance(value, str):
        try:
            value = json_input.loads(value)
        except ValueError as exc:
            raise InvalidRequest(f"grammar is not valid: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("grammar is not supported")
    if "properties" not in value:
        raise InvalidRequest("grammar is not valid: Grammar must have a 'properties' field")
    return value


def _structured(grammar: Grammar | None) -> StructuredOutput | None:
    if grammar is None:
        return None
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise InvalidRequest("grammar is not valid: a regex grammar's value must be a string")
        try:
            re.compile(grammar.value)
        except re.error as exc:
            raise InvalidRequest(f"grammar is not valid: {exc}") from None
        return StructuredOutput(regex=grammar.value)
    if grammar.type == "json_schema":
        if not isinstance(grammar.value, dict) or "schema" not in grammar.value:
            raise InvalidRequest("grammar is not valid: missing field `schema`")
        return StructuredOutput(json=_schema(grammar.value["schema"]))
    return StructuredOutput(json=_schema(grammar.value))


def to_generation_request(
    body: GenerateRequest, *, stream: bool, max_total_tokens: int, compat: bool = False
) -> GenerationRequest:
    """Validate as TGI's router does and translate. ``compat`` is ``POST /``, where an unset
    ``return_full_text`` defaults to true (the pipeline tag is text-generation)."""
    p = body.parameters if body.parameters is not None else GenerateParameters(do_sample=True)
    best_of = 1 if p.best_of is None else p.best_of
    if stream and best_of != 1:
        raise InvalidRequest("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise InvalidRequest("`decoder_input_details` == true is not supported when streaming tokens")
    if best_of > MAX_BEST_OF or best_of == 0:
        raise InvalidRequest(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}")
    do_sample = bool(p.do_sample)
    _range_checks(p, do_sample, best_of)
    _limit_checks(body.inputs, p, max_total_tokens)
    structured = _structured(p.grammar)
    # TGI's server samples when asked to, or when any warper would change the distribution.
    sampling = (
        do_sample or (p.temperature is not None and p.temperature != 1.0) or p.top_k is not None or p.top_p is not None
    )
    max_new = p.max_new_tokens or min(DEFAULT_GENERATION_LENGTH, max_total_tokens - 1)
    top_n = p.top_n_tokens or 0
    decoder_details = bool(p.decoder_input_details) and not stream
    return_full_text = p.return_full_text if p.return_full_text is not None else compat
    params = SamplingParams(
        n=best_of,
        temperature=(1.0 if p.temperature is None else p.temperature) if sampling else 0.0,
        top_p=(p.top_p or 1.0) if sampling else 1.0,
        top_k=(p.top_k or 0) if sampling else 0,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=p.seed if sampling else None,
        max_tokens=max_new,
        stop=[s for s in p.stop or () if s],
        # TGI's generated text ends with the stop sequence that ended it.
        include_stop_str_in_output=True,
        # Every TGI token carries its logprob; top_n_tokens adds the alternatives.
        logprobs=top_n,
        prompt_logprobs=0 if decoder_details else None,
        structured=structured,
    )
    output = OutputOptions(
        details=bool(p.details) or decoder_details,
        return_full_text=bool(return_full_text),
        prompt_tokens=decoder_details,
    )
    # TGI's LoRA field names the adapter (shared/adapters.py), as other dialects' `model` does.
    return GenerationRequest(model=p.adapter_id or "", prompt=body.inputs, sampling=params, output=output,
                             dialect=NAME)


def with_prompt_ids(req: GenerationRequest, ids: list[int]) -> GenerationRequest:
    """The request with its input replaced by (truncated) token ids."""
    return msgspec.structs.replace(req, prompt=None, prompt_token_ids=ids)
