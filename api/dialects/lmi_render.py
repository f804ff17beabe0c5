"""LMI's response shapes: rolling batch, TGI compatibility and dynamic batch.

Rolling-batch streams are JSON lines by default, SSE when configured; only the last line
carries ``generated_text`` (and ``details``). With several sequences (``n``, ``best_of``,
``num_beams``) ``generated_text`` is the most likely one and the others are in
``details.best_of_sequences``.

Every shape is a Struct whose field order is the key order on the wire; a key LMI sends only
sometimes is ``UNSET`` (omitted), a key it sends as ``null`` is ``None``. The token objects differ
between LMI (``log_prob``, ``special_token`` only when true) and TGI compatibility (``logprob``,
``special`` always), so the shapes that hold tokens are generic over the token type.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.stream import JSONLINES, SSE, StreamRenderer
from shared.errors import ServiceError
from shared.events import Done, TokenDelta, Tokens
from shared.framing import jsonline, sse
from shared.schemas import Choice, GenerationRequest, JobResult, PromptInfo, TopLogprob

__all__ = [
    "LmiToken",
    "TgiToken",
    "Sequence",
    "Details",
    "LmiResult",
    "BatchResult",
    "StreamDetails",
    "StreamLine",
    "TgiStreamLine",
    "ErrorLine",
    "BatchOutputs",
    "BatchError",
    "render_result",
    "render_batch_result",
    "LmiStream",
    "BatchStream",
    "stream",
    "batch_error",
]

TGI = "lmi_tgi"
BATCH = "lmi_batch"


class LmiToken(msgspec.Struct, kw_only=True):
    id: int
    text: str
    log_prob: float | None
    special_token: bool | UnsetType = UNSET
    """Only the end-of-sequence token says so."""


class TgiToken(msgspec.Struct, kw_only=True):
    """TGI's field names (DJL's ``Token.as_tgi_dict``)."""

    id: int
    text: str
    logprob: float | None
    special: bool


T = TypeVar("T", LmiToken, TgiToken)


class Sequence(msgspec.Struct, Generic[T], kw_only=True):
    """One of ``details.best_of_sequences``."""

    generated_text: str
    finish_reason: str
    generated_tokens: int
    tokens: list[T]
    top_tokens: list[list[T]] | UnsetType = UNSET


class Details(msgspec.Struct, Generic[T], kw_only=True):
    finish_reason: str
    generated_tokens: int | None
    inputs: str | None
    tokens: list[T] | None
    seed: int | None | UnsetType = UNSET
    """TGI compatibility only."""
    prefill: list[T] | UnsetType = UNSET
    top_tokens: list[list[T]] | UnsetType = UNSET
    best_of_sequences: list[Sequence[T]] | UnsetType = UNSET


class LmiResult(msgspec.Struct, Generic[T], kw_only=True):
    generated_text: str
    details: Details[T] | UnsetType = UNSET


class BatchResult(msgspec.Struct, kw_only=True):
    """Dynamic batch: one per input."""

    generated_text: str


class StreamDetails(msgspec.Struct, kw_only=True):
    finish_reason: str
    generated_tokens: int | None
    inputs: str | None
    input_length: int | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    """``input_length`` and ``seed``: TGI compatibility only."""


class StreamLine(msgspec.Struct, Generic[T], kw_only=True):
    """A rolling-batch stream line; the last one adds ``generated_text`` (and ``details``)."""

    token: T
    top_tokens: list[T] | UnsetType = UNSET
    generated_text: str | UnsetType = UNSET
    details: StreamDetails | UnsetType = UNSET


class TgiStreamLine(msgspec.Struct, kw_only=True):
    """TGI's stream shape: ``generated_text`` and ``details`` are null until the last line."""

    index: int = 0
    token: TgiToken
    generated_text: str | None = None
    details: StreamDetails | None = None
    top_tokens: list[TgiToken] | UnsetType = UNSET


class ErrorLine(msgspec.Struct, kw_only=True):
    """The documented last line of a stream that failed (LMI's token shape, even under TGI)."""

    token: LmiToken
    generated_text: str
    details: StreamDetails
    error: str


class BatchOutputs(msgspec.Struct):
    """A dynamic-batch stream line: each input's new text."""

    outputs: list[str]


class BatchError(msgspec.Struct, kw_only=True):
    """The dynamic-batch handler's failure (also its stream's last line)."""

    code: int
    message: str
    error: str


def batch_error(message: str) -> BatchError:
    return BatchError(code=424, message="invoke handler failure", error=message)


def finish_reason(choice_reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's vocabulary to LMI's documented one: length | eos_token | stop_sequence."""
    if choice_reason == "length":
        return "length"
    if choice_reason == "stop":
        return "eos_token" if stop_reason is None else "stop_sequence"
    return choice_reason or "error"


def _token(req: GenerationRequest, tid: int, text: str, logprob: float | None,
           special: bool = False) -> LmiToken | TgiToken:
    if req.dialect == TGI:
        return TgiToken(id=tid, text=text, logprob=logprob, special=special)
    return LmiToken(id=tid, text=text, log_prob=logprob, special_token=True if special else UNSET)


def _eos_index(choice_reason: str | None, stop_reason: str | int | None, count: int) -> int:
    """Which token is the end-of-sequence token (the only special token the API can tell apart
    without a tokenizer): the last one, when EOS ended the sequence."""
    return count - 1 if choice_reason == "stop" and stop_reason is None else -1


def _tokens(req: GenerationRequest, c: Choice) -> list:
    eos = _eos_index(c.finish_reason, c.stop_reason, len(c.token_ids))
    texts = c.token_texts or [""] * len(c.token_ids)
    logprobs: list[float] | list[None] = c.logprobs or [None] * len(c.token_ids)
    return [_token(req, tid, texts[i], logprobs[i], i == eos) for i, tid in enumerate(c.token_ids)]


def _top_tokens(req: GenerationRequest, tops: list[list[TopLogprob]] | None, k: int) -> list[list]:
    return [[_token(req, t.id, t.text, t.logprob) for t in top[:k]] for top in tops or []]


def _prefill(req: GenerationRequest, prompt: PromptInfo | None) -> list:
    if prompt is None:
        return []
    logprobs = prompt.logprobs or [None] * len(prompt.token_ids)
    return [_token(req, tid, prompt.token_texts[i], logprobs[i]) for i, tid in enumerate(prompt.token_ids)]


def _generated_text(req: GenerationRequest, text: str) -> str:
    return (req.prompt or "") + text if req.output.return_full_text else text


def _ranked(req: GenerationRequest, choices: list[Choice]) -> list[Choice]:
    """Beams arrive best first; samples are ranked by their cumulative logprob."""
    if req.sampling.beam_width > 1 or len(choices) < 2:
        return choices
    return sorted(choices, key=lambda c: sum(c.logprobs or ()), reverse=True)


def _sequence(req: GenerationRequest, c: Choice, top_n: int) -> Sequence:
    return Sequence(
        generated_text=_generated_text(req, c.text),
        finish_reason=finish_reason(c.finish_reason, c.stop_reason),
        generated_tokens=len(c.token_ids),
        tokens=_tokens(req, c),
        top_tokens=_top_tokens(req, c.top_logprobs, top_n) if top_n else UNSET,
    )


def _batch_result(result: JobResult) -> BatchResult:
    return BatchResult(generated_text=result.choices[0].text if result.choices else "")


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "",
                  created: int = 0) -> LmiResult | list[LmiResult] | BatchResult:
    """Rolling batch: one object; TGI compatibility: a one-element array; one dynamic-batch job
    (``GET /v1/jobs/{id}`` of one of its jobs): its ``{"generated_text"}``."""
    if req.dialect == BATCH:
        return _batch_result(result)
    choices = _ranked(req, result.choices) or [Choice()]
    best = choices[0]
    body = LmiResult(generated_text=_generated_text(req, best.text))
    top_n = req.sampling.logprobs if req.sampling.logprobs else 0
    if req.output.details or len(choices) > 1:
        body.details = Details(
            finish_reason=finish_reason(best.finish_reason, best.stop_reason),
            generated_tokens=len(best.token_ids),
            inputs=req.prompt,
            tokens=_tokens(req, best),
            seed=req.sampling.seed if req.dialect == TGI else UNSET,
            prefill=_prefill(req, result.prompt) if req.output.prompt_tokens else UNSET,
            top_tokens=_top_tokens(req, best.top_logprobs, top_n) if top_n else UNSET,
            best_of_sequences=[_sequence(req, c, top_n) for c in choices[1:]] if len(choices) > 1 else UNSET,
        )
    return [body] if req.dialect == TGI else body


def render_batch_result(results: list[JobResult]) -> list[BatchResult]:
    """Dynamic batch: one ``{"generated_text"}`` per input, in input order."""
    return [_batch_result(r) for r in results]


# --- streams --------------------------------------------------------------------------------

def _error_line(message: str) -> ErrorLine:
    # log_prob is the integer -1 on the wire, as DJL sends it.
    return ErrorLine(
        token=LmiToken(id=-1, text="", log_prob=-1, special_token=True),
        generated_text="",
        details=StreamDetails(finish_reason="error", generated_tokens=None, inputs=None),
        error=message,
    )


Line = StreamLine | TgiStreamLine | ErrorLine


def _delta_lines(req: GenerationRequest, delta: TokenDelta, top_n: int) -> list[StreamLine | TgiStreamLine]:
    """One line per token. The text is the incremental detokeniser's, not each token decoded
    alone, so the lines always add up to ``generated_text`` even when a character spans several
    byte-level tokens; when one delta holds several tokens its text rides on the last one."""
    count = len(delta.token_ids)
    texts = [""] * (count - 1) + [delta.text]
    logprobs: list[float] | list[None] = delta.logprobs or [None] * count
    eos = _eos_index(delta.finish_reason, delta.stop_reason, count)
    lines: list[StreamLine | TgiStreamLine] = []
    for i, tid in enumerate(delta.token_ids):
        token = _token(req, tid, texts[i], logprobs[i], i == eos)
        top = _top_tokens(req, [delta.top_logprobs[i]], top_n)[0] if top_n and delta.top_logprobs else UNSET
        if isinstance(token, TgiToken):
            lines.append(TgiStreamLine(token=token, top_tokens=top))
        else:
            lines.append(StreamLine(token=token, top_tokens=top))
    return lines


class LmiStream(StreamRenderer[bytes]):
    """Rolling batch (and TGI compatibility): one line per token, the last one carrying
    ``generated_text`` (and ``details`` when asked for); a failure is the documented error line.
    JSON lines by default, SSE with LMI's ``sse`` output formatter. Keep-alives send nothing:
    JSON lines has no comment syntax, and SSE keep-alives are not LMI's either."""

    def __init__(self, req: GenerationRequest, job_id: str = "", created: int = 0, *, sse_format: bool = False
                 ) -> None:
        self.req = req
        self.frame = sse if sse_format else jsonline
        self.media_type = SSE if sse_format else JSONLINES
        self.text_parts: list[str] = []
        self.generated = 0
        self.top_n = req.sampling.logprobs or 0

    def step(self, event: Tokens | Done) -> list[bytes]:
        req = self.req
        for delta in event.deltas:
            self.text_parts.append(delta.text)
            self.generated += len(delta.token_ids)
        lines = [line for delta in event.deltas for line in _delta_lines(req, delta, self.top_n)]
        if isinstance(event, Done):
            # The last line carries the last token plus generated_text (and details when asked).
            # With no token at all it is a bare line around an empty special token (TGI's too: a
            # StreamLine, whose T is either token type, which mypy cannot tell from _token's union).
            last = lines.pop() if lines else StreamLine(token=_token(req, -1, "", None, True))  # type: ignore[type-var]
            last.generated_text = _generated_text(req, "".join(self.text_parts))
            if req.output.details:
                final = event.deltas[-1] if event.deltas else TokenDelta()
                tgi = req.dialect == TGI
                last.details = StreamDetails(
                    finish_reason=finish_reason(final.finish_reason, final.stop_reason),
                    generated_tokens=self.generated,
                    inputs=req.prompt,
                    input_length=event.usage.prompt_tokens if tgi else UNSET,
                    seed=req.sampling.seed if tgi else UNSET,
                )
            lines.append(last)
        return [self.frame(line) for line in lines]

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [self.frame(_error_line(exc.message))]


class BatchStream(StreamRenderer[bytes]):
    """Dynamic-batch streaming: ``{"outputs": [...]}`` lines, one entry per input (its new text)."""

    media_type = JSONLINES

    def __init__(self, inputs: int) -> None:
        self.inputs = inputs

    def step(self, event: Tokens | Done) -> list[bytes]:
        outputs = [""] * self.inputs
        for delta in event.deltas:
            outputs[delta.index] += delta.text
        return [jsonline(BatchOutputs(outputs))] if any(outputs) else []

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [jsonline(batch_error(exc.message))]


def stream(req: GenerationRequest, job_id: str, created: int) -> LmiStream | BatchStream:
    """A stored job's stream in the shape that queued it (TGI compatibility streams SSE; one job of
    a dynamic batch is one input)."""
    if req.dialect == BATCH:
        return BatchStream(1)
    return LmiStream(req, job_id, created, sse_format=req.dialect == TGI)
