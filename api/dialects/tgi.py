"""Hugging Face TGI (text-generation-inference): ``/generate``, ``/generate_stream`` and ``/``.

Validation follows TGI's router (``validation.rs``): its rules, its order and its messages, as
``{"error": "Input validation error: ...", "error_type": "validation"}`` with 422. Streams are
``data:{json}\\n\\n`` (no space, no terminator); only the last event carries ``generated_text``
and ``details``. A stream always answers 200: every error, even a validation error, is one
``data:{"error":...,"error_type":...}`` event that ends it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects.stream import SseKeepalive, StreamRenderer
from shared import json_input
from shared.errors import EngineDead, GenerationFailed, InvalidRequest, JobCancelled, JobMissing, ServiceError
from shared.events import Done, TokenDelta, Tokens
from shared.framing import sse
from shared.schemas import (
    Choice,
    GenerationRequest,
    JobResult,
    OutputOptions,
    SamplingParams,
    StructuredOutput,
    TopLogprob,
)

__all__ = [
    "NAME",
    "GenerateRequest",
    "to_generation_request",
    "render_result",
    "TgiStream",
    "TokenRecorder",
    "stream",
    "error_body",
    "error_frame",
    "TokenTexts",
    "Token",
    "GenerateResponse",
    "StreamResponse",
    "ErrorResponse",
    "Info",
    "SimpleToken",
]

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


class IncompleteGeneration(ServiceError, code="incomplete_generation"):
    """A finished job with no sequence to answer with (TGI's ``IncompleteGeneration``)."""


class IncompleteGenerationStream(ServiceError, code="incomplete_generation_stream"):
    """A stream's events ended without its final one."""


# --- responses: TGI's own objects (router/src/lib.rs), in its key order --------------------------
# UNSET marks keys TGI skips (``skip_serializing_if``); None is a key TGI sends as null.


class Token(msgspec.Struct):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(msgspec.Struct):
    id: int
    text: str
    logprob: float | None


class BestOfSequence(msgspec.Struct, kw_only=True):
    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | UnsetType = UNSET
    """Present whenever top_n_tokens was asked for, even empty."""


class Details(msgspec.Struct, kw_only=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    best_of_sequences: list[BestOfSequence] | UnsetType = UNSET
    top_tokens: list[list[Token]] | UnsetType = UNSET
    """Only when not empty."""


class GenerateResponse(msgspec.Struct, kw_only=True):
    generated_text: str
    details: Details | UnsetType = UNSET


class StreamDetails(msgspec.Struct, kw_only=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(msgspec.Struct, kw_only=True):
    index: int
    token: Token
    top_tokens: list[Token] | UnsetType = UNSET
    """Only when not empty (TGI skips an empty list)."""
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(msgspec.Struct):
    error: str
    error_type: str


class SimpleToken(msgspec.Struct):
    """One token of ``POST /tokenize``, with its slice of the input (character offsets)."""

    id: int
    text: str
    start: int
    stop: int


class Info(msgspec.Struct, kw_only=True):
    """``GET /info``."""

    model_id: str
    model_sha: str | None = None
    model_pipeline_tag: str = "text-generation"
    max_concurrent_requests: int
    max_best_of: int = MAX_BEST_OF
    max_stop_sequences: int = MAX_STOP_SEQUENCES
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int = 1
    max_client_batch_size: int = MAX_CLIENT_BATCH_SIZE
    router: str = "llmq"
    version: str
    sha: str | None = None
    docker_label: str | None = None


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


# --- rendering ------------------------------------------------------------------------------


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's vocabulary to TGI's: length | eos_token | stop_sequence (a stop token id is EOS)."""
    if reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"


def token(tid: int, text: str, logprob: float | None, special: bool) -> Token:
    return Token(tid, text, logprob, special)


def _fit(values: list | None, n: int, fill: Any) -> list:
    return list(values) if values is not None and len(values) == n else [fill] * n


class TokenTexts:
    """Each generated token's text, for one sequence, fed its deltas in order.

    TGI prints each token's incremental text. The engine reports incremental text per delta, and
    a delta may hold several tokens (vLLM merges steps when the reader lags), so the text is
    split here using each token decoded alone, in a way that does not depend on how the tokens
    were grouped. A token whose text alone is clean and found in the text takes it (plus any
    invalid bytes held back before it, as the engine's detokeniser releases them); a token that
    is part of a character (its text alone has U+FFFD) or does not match takes what is left
    before the next match, or at the end of its delta. Special tokens keep their own text (the
    engine skips it); the last token is special when EOS ended the sequence. The non-special
    texts always add up to the generated text.
    """

    def __init__(self, special: frozenset[int] = frozenset()) -> None:
        self.special = special
        self.pending = ""  # text received but not yet given to a token

    def tokens(
        self,
        ids: list[int],
        alone: list[str] | None,
        text: str,
        logprobs: list[float] | None,
        reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> list[Token]:
        flags = [tid in self.special for tid in ids]
        if flags and reason == "stop" and not isinstance(stop_reason, str):
            flags[-1] = True
        alone = _fit(alone, len(ids), "")
        texts = [a if f else "" for a, f in zip(alone, flags, strict=True)]
        self.pending += text
        partial = None
        for i, a in enumerate(alone):
            q = self.pending.find(a) if a and "\ufffd" not in a and not flags[i] else -1
            if q < 0:
                partial = i if not flags[i] else partial
                continue
            gap, self.pending = self.pending[:q], self.pending[q + len(a) :]
            if gap and partial is not None and "\ufffd" not in gap:
                texts[partial], gap = gap, ""  # the character the partial tokens before completed
            texts[i], partial = gap + a, None
        if partial is not None and not self.pending.endswith("\ufffd"):
            texts[partial], self.pending = texts[partial] + self.pending, ""
        plain = [i for i, f in enumerate(flags) if not f]
        if reason is not None and self.pending and plain:  # the end: nothing may be left over
            texts[plain[-1]], self.pending = texts[plain[-1]] + self.pending, ""
        lps = _fit(logprobs, len(ids), None)
        return [Token(tid, texts[i], lps[i], flags[i]) for i, tid in enumerate(ids)]

    def delta(self, d: TokenDelta) -> list[Token]:
        return self.tokens(d.token_ids, d.token_texts, d.text, d.logprobs, d.finish_reason, d.stop_reason)


def top_tokens_of(
    tops: Iterable[list[TopLogprob]] | None, special: frozenset[int] = frozenset()
) -> list[list[Token]]:
    return [[Token(t.id, t.text, t.logprob, t.id in special) for t in top] for top in tops or ()]


def full_text_prefix(req: GenerationRequest, inputs: str | None) -> str:
    if not req.output.return_full_text:
        return ""
    return inputs if inputs is not None else (req.prompt or "")


def reported_seed(req: GenerationRequest) -> int | None:
    return req.sampling.seed if req.sampling.temperature > 0 else None


def _prefill(result: JobResult) -> list[PrefillToken]:
    p = result.prompt
    if p is None:
        return []
    texts, lps = _fit(p.token_texts, len(p.token_ids), ""), _fit(p.logprobs, len(p.token_ids), None)
    return [PrefillToken(tid, texts[i], lps[i]) for i, tid in enumerate(p.token_ids)]


def _sequence(
    req: GenerationRequest,
    choice: Choice,
    tokens: list[Token] | None,
    prefill: list[PrefillToken],
    prefix: str,
    special: frozenset[int],
) -> BestOfSequence:
    if tokens is None:  # no per-event tokens (a stored result): the whole choice as one run
        c = choice
        tokens = TokenTexts(special).tokens(
            c.token_ids, c.token_texts, c.text, c.logprobs, c.finish_reason, c.stop_reason
        )
    return BestOfSequence(
        generated_text=prefix + choice.text,
        finish_reason=finish_reason(choice.finish_reason, choice.stop_reason),
        generated_tokens=len(choice.token_ids),
        seed=reported_seed(req),
        prefill=prefill,
        tokens=tokens,
        top_tokens=top_tokens_of(choice.top_logprobs, special) if req.sampling.logprobs else UNSET,
    )


def _best(choices: list[Choice]) -> int:
    """best_of: the sequence with the highest cumulative logprob wins."""
    return max(range(len(choices)), key=lambda i: sum(choices[i].logprobs or ()) if choices[i].token_ids else -1e30)


def render_result(
    req: GenerationRequest,
    result: JobResult,
    job_id: str = "",
    created: int = 0,
    *,
    inputs: str | None = None,
    tokens: dict[int, list[Token]] | None = None,
    special: frozenset[int] = frozenset(),
) -> GenerateResponse:
    """GenerateResponse. ``tokens`` are the per-choice tokens built event by event (so they match
    the stream exactly); without them they are rebuilt from the folded result."""
    if not result.choices:
        raise IncompleteGeneration("Incomplete generation")
    prefix = full_text_prefix(req, inputs)
    best = _best(result.choices)
    choice = result.choices[best]
    if not req.output.details:
        return GenerateResponse(generated_text=prefix + choice.text)
    prefill = _prefill(result)
    seqs = [_sequence(req, c, (tokens or {}).get(c.index), prefill, prefix, special) for c in result.choices]
    won = seqs[best]
    details = Details(
        finish_reason=won.finish_reason,
        generated_tokens=won.generated_tokens,
        seed=won.seed,
        prefill=won.prefill,
        tokens=won.tokens,
        best_of_sequences=[s for i, s in enumerate(seqs) if i != best] if len(seqs) > 1 else UNSET,
        top_tokens=won.top_tokens or UNSET,
    )
    return GenerateResponse(generated_text=prefix + choice.text, details=details)


# --- streaming ------------------------------------------------------------------------------


def _event(index: int, token: Token, top: list[Token] | None, text: str | None, details: StreamDetails | None
           ) -> bytes:
    """A StreamResponse: ``top_tokens`` only when asked for (TGI skips an empty list)."""
    event = StreamResponse(index=index, token=token, top_tokens=top or UNSET, generated_text=text, details=details)
    return sse(event, space=False)


def _stream_details(req: GenerationRequest, done: Done, generated: int) -> StreamDetails | None:
    if not req.output.details:
        return None
    final = done.deltas[-1] if done.deltas else TokenDelta()
    return StreamDetails(
        finish_reason=finish_reason(final.finish_reason, final.stop_reason),
        generated_tokens=generated,
        seed=reported_seed(req),
        input_length=done.usage.prompt_tokens,
    )


class TgiStream(SseKeepalive, StreamRenderer[bytes]):
    """One event per token, counted from 1; the last token's event also carries
    ``generated_text`` and ``details``. Events that end without a final one end with TGI's
    ``incomplete_generation_stream`` error."""

    def __init__(self, req: GenerationRequest, job_id: str = "", created: int = 0, *, inputs: str = "",
                 special: frozenset[int] = frozenset()) -> None:
        self.req, self.inputs, self.special = req, inputs, special
        self.index = self.generated = 0
        self.parts: list[str] = []
        self.texts = TokenTexts(special)
        self.ended = False

    def step(self, event: Tokens | Done) -> list[bytes]:
        pending: list[tuple[Token, list[Token] | None]] = []
        for d in event.deltas:
            self.parts.append(d.text)
            self.generated += len(d.token_ids)
            tops = top_tokens_of(d.top_logprobs, self.special)
            pending += [(t, tops[i] if i < len(tops) else None) for i, t in enumerate(self.texts.delta(d))]
        last = None
        if isinstance(event, Done):
            # Done carries the last engine step's tokens: its last token is the final event.
            last = pending.pop() if pending else (Token(0, "", None, True), None)
        out = []
        for tok, top in pending:
            self.index += 1
            out.append(_event(self.index, tok, top, None, None))
        if last is not None:
            self.ended = True
            text = full_text_prefix(self.req, self.inputs) + "".join(self.parts)
            out.append(_event(self.index + 1, *last, text, _stream_details(self.req, event, self.generated)))
        return out

    def fail(self, exc: ServiceError) -> list[bytes]:
        self.ended = True
        return [error_frame(exc)]

    def close(self) -> list[bytes]:
        return [] if self.ended else [error_frame(IncompleteGenerationStream("Incomplete generation stream"))]


def stream(req: GenerationRequest, job_id: str, created: int) -> TgiStream:
    return TgiStream(req, job_id, created, inputs=req.prompt or "")


class TokenRecorder:
    """A non-streamed answer's tokens, kept event by event as :class:`TgiStream` splits them, so
    the answer has exactly the tokens (and texts) a stream would have sent."""

    def __init__(self, special: frozenset[int] = frozenset()) -> None:
        self.special = special
        self.tokens: dict[int, list[Token]] = {}
        self._texts: dict[int, TokenTexts] = {}

    def seen(self, event: Tokens | Done) -> None:
        for delta in event.deltas:
            texts = self._texts.setdefault(delta.index, TokenTexts(self.special))
            self.tokens.setdefault(delta.index, []).extend(texts.delta(delta))


def error_frame(exc: ServiceError) -> bytes:
    """An error as TGI sends it inside a stream (also before any token: streams always get 200)."""
    return sse(error_body(exc)[1], space=False)


# --- errors -------------------------------------------------------------------------------

# Failures of the generation itself (TGI's InferError::GenerationError): 424.
_GENERATION = (GenerationFailed, EngineDead, JobCancelled, JobMissing)


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    """TGI's ErrorResponse and statuses: 422 validation, 424 generation, 429 overloaded,
    500 incomplete_generation; other llmq errors keep their status and name their code."""
    if exc.status in (400, 422):
        return 422, ErrorResponse(f"Input validation error: {exc.message}", "validation")
    if exc.status == 429:
        return 429, ErrorResponse(exc.message, "overloaded")
    if isinstance(exc, _GENERATION):
        return 424, ErrorResponse(f"Request failed during generation: {exc.message}", "generation")
    if isinstance(exc, IncompleteGenerationStream):
        return 500, ErrorResponse(exc.message, exc.code)
    if exc.status == 500:
        return 500, ErrorResponse(exc.message, "incomplete_generation")
    return exc.status, ErrorResponse(exc.message, exc.code)
