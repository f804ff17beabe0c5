"""Hugging Face TGI (text-generation-inference): ``/generate``, ``/generate_stream`` and ``/``.

Validation follows TGI's router (``validation.rs``): its rules, its order and its messages, as
``{"error": "Input validation error: ...", "error_type": "validation"}`` with 422. Streams are
``data:{json}\\n\\n`` (no space, no terminator); only the last event carries ``generated_text``
and ``details``. A stream always answers 200: every error, even a validation error, is one
``data:{"error":...,"error_type":...}`` event that ends it.

This module is the dialect (its answers, stream and errors) and exports what routes use from the
other two: :mod:`api.dialects.tgi_request` (the request, checked and translated) and
:mod:`api.dialects.tgi_tokens` (each token's text). The answer and the stream stay here with the
error objects because /openapi.json names ``GenerateResponse`` and ``ErrorResponse`` by this
module's path (Triton has objects of the same names).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.stream import SseKeepalive, StreamRenderer
from api.dialects.tgi_request import (
    MAX_BEST_OF,
    MAX_CLIENT_BATCH_SIZE,
    MAX_STOP_SEQUENCES,
    NAME,
    GenerateParameters,
    GenerateRequest,
    to_generation_request,
    with_prompt_ids,
)
from api.dialects.tgi_tokens import PrefillToken, Token, TokenRecorder, TokenTexts, fit, top_tokens_of
from shared.errors import (
    EngineDead,
    GenerationFailed,
    IncompleteGeneration,
    IncompleteGenerationStream,
    JobCancelled,
    JobMissing,
    ServiceError,
)
from shared.events import Done, TokenDelta, Tokens
from shared.framing import sse
from shared.schemas import Choice, GenerationRequest, JobResult

__all__ = [
    "NAME",
    "GenerateParameters",
    "GenerateRequest",
    "to_generation_request",
    "with_prompt_ids",
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


# --- responses: TGI's own objects (router/src/lib.rs), in its key order --------------------------
# UNSET marks keys TGI skips (``skip_serializing_if``); None is a key TGI sends as null. Token and
# PrefillToken are api.dialects.tgi_tokens's.


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


# --- rendering ------------------------------------------------------------------------------


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's vocabulary to TGI's: length | eos_token | stop_sequence (a stop token id is EOS)."""
    if reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"


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
    texts, lps = fit(p.token_texts, len(p.token_ids), ""), fit(p.logprobs, len(p.token_ids), None)
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
        last: tuple[Token, list[Token] | None] | None = None
        details: StreamDetails | None = None
        if isinstance(event, Done):
            # Done carries the last engine step's tokens: its last token is the final event.
            last = pending.pop() if pending else (Token(0, "", None, True), None)
            details = _stream_details(self.req, event, self.generated)
        out = []
        for tok, top in pending:
            self.index += 1
            out.append(_event(self.index, tok, top, None, None))
        if last is not None:
            self.ended = True
            text = full_text_prefix(self.req, self.inputs) + "".join(self.parts)
            out.append(_event(self.index + 1, *last, text, details))
        return out

    def fail(self, exc: ServiceError) -> list[bytes]:
        self.ended = True
        return [error_frame(exc)]

    def close(self) -> list[bytes]:
        return [] if self.ended else [error_frame(IncompleteGenerationStream("Incomplete generation stream"))]


def stream(req: GenerationRequest, job_id: str, created: int) -> TgiStream:
    return TgiStream(req, job_id, created, inputs=req.prompt or "")


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
