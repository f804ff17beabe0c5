"""LMI's response shapes: rolling batch, TGI compatibility and dynamic batch.

Rolling-batch streams are JSON lines by default, SSE when configured; only the last line
carries ``generated_text`` (and ``details``). With several sequences (``n``, ``best_of``,
``num_beams``) ``generated_text`` is the most likely one and the others are in
``details.best_of_sequences``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from shared.errors import ServiceError
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.framing import Keepalive, jsonline, sse
from shared.schemas import Choice, GenerationRequest, JobResult, PromptInfo, TopLogprob

__all__ = ["render_result", "render_batch_result", "render_stream", "render_batch_stream"]

TGI = "lmi_tgi"
BATCH = "lmi_batch"


def finish_reason(choice_reason: str | None, stop_reason: str | int | None) -> str:
    """vLLM's vocabulary to LMI's documented one: length | eos_token | stop_sequence."""
    if choice_reason == "length":
        return "length"
    if choice_reason == "stop":
        return "eos_token" if stop_reason is None else "stop_sequence"
    return choice_reason or "error"


def _token(req: GenerationRequest, tid: int, text: str, logprob: float | None, special: bool = False) -> dict:
    if req.dialect == TGI:  # TGI's field names (Token.as_tgi_dict)
        return {"id": tid, "text": text, "logprob": logprob, "special": special}
    token: dict[str, Any] = {"id": tid, "text": text, "log_prob": logprob}
    if special:
        token["special_token"] = True
    return token


def _eos_index(choice_reason: str | None, stop_reason: str | int | None, count: int) -> int:
    """Which token is the end-of-sequence token (the only special token the API can tell apart
    without a tokenizer): the last one, when EOS ended the sequence."""
    return count - 1 if choice_reason == "stop" and stop_reason is None else -1


def _tokens(req: GenerationRequest, c: Choice) -> list[dict]:
    eos = _eos_index(c.finish_reason, c.stop_reason, len(c.token_ids))
    texts, logprobs = c.token_texts or [""] * len(c.token_ids), c.logprobs or [None] * len(c.token_ids)
    return [_token(req, tid, texts[i], logprobs[i], i == eos) for i, tid in enumerate(c.token_ids)]


def _top_tokens(req: GenerationRequest, tops: list[list[TopLogprob]] | None, k: int) -> list[list[dict]]:
    return [[_token(req, t.id, t.text, t.logprob) for t in top[:k]] for top in tops or []]


def _prefill(req: GenerationRequest, prompt: PromptInfo | None) -> list[dict]:
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


def _sequence(req: GenerationRequest, c: Choice, top_n: int) -> dict[str, Any]:
    seq: dict[str, Any] = {
        "generated_text": _generated_text(req, c.text),
        "finish_reason": finish_reason(c.finish_reason, c.stop_reason),
        "generated_tokens": len(c.token_ids),
        "tokens": _tokens(req, c),
    }
    if top_n:
        seq["top_tokens"] = _top_tokens(req, c.top_logprobs, top_n)
    return seq


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> Any:
    if req.dialect == BATCH:
        return {"generated_text": result.choices[0].text if result.choices else ""}
    choices = _ranked(req, result.choices) or [Choice()]
    best = choices[0]
    body: dict[str, Any] = {"generated_text": _generated_text(req, best.text)}
    top_n = req.sampling.logprobs if req.sampling.logprobs else 0
    if req.output.details or len(choices) > 1:
        details: dict[str, Any] = {
            "finish_reason": finish_reason(best.finish_reason, best.stop_reason),
            "generated_tokens": len(best.token_ids),
            "inputs": req.prompt,
            "tokens": _tokens(req, best),
        }
        if req.dialect == TGI:
            details["seed"] = req.sampling.seed
        if req.output.prompt_tokens:
            details["prefill"] = _prefill(req, result.prompt)
        if top_n:
            details["top_tokens"] = _top_tokens(req, best.top_logprobs, top_n)
        if len(choices) > 1:
            details["best_of_sequences"] = [_sequence(req, c, top_n) for c in choices[1:]]
        body["details"] = details
    return [body] if req.dialect == TGI else body


def render_batch_result(results: list[JobResult]) -> list[dict[str, str]]:
    """Dynamic batch: one ``{"generated_text"}`` per input, in input order."""
    return [{"generated_text": r.choices[0].text if r.choices else ""} for r in results]


# --- streams --------------------------------------------------------------------------------

_ERROR_LINE = {
    "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
}


def _delta_lines(req: GenerationRequest, delta: TokenDelta, top_n: int) -> list[dict[str, Any]]:
    """One line per token. The text is the incremental detokeniser's, not each token decoded
    alone, so the lines always add up to ``generated_text`` even when a character spans several
    byte-level tokens; when one delta holds several tokens its text rides on the last one."""
    count = len(delta.token_ids)
    texts = [""] * (count - 1) + [delta.text]
    logprobs = delta.logprobs or [None] * count
    eos = _eos_index(delta.finish_reason, delta.stop_reason, count)
    lines = []
    for i, tid in enumerate(delta.token_ids):
        line: dict[str, Any] = {"token": _token(req, tid, texts[i], logprobs[i], i == eos)}
        if req.dialect == TGI:
            line = {"index": 0, **line, "generated_text": None, "details": None}
        if top_n and delta.top_logprobs:
            line["top_tokens"] = _top_tokens(req, [delta.top_logprobs[i]], top_n)[0]
        lines.append(line)
    return lines


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
    top_n = req.sampling.logprobs or 0
    async for event in events:
        if isinstance(event, Keepalive):
            continue  # JSON lines has no comment syntax; SSE keep-alives are not LMI's either
        if isinstance(event, Error):
            yield {**_ERROR_LINE, "error": event.message}
            return
        assert isinstance(event, (Tokens, Done))
        lines = [line for delta in event.deltas for line in _delta_lines(req, delta, top_n)]
        for delta in event.deltas:
            text_parts.append(delta.text)
            generated += len(delta.token_ids)
        if isinstance(event, Tokens):
            for line in lines:
                yield line
            continue
        # The last line carries the last token plus generated_text (and details when asked).
        last = lines.pop() if lines else {"token": _token(req, -1, "", None, True)}
        for line in lines:
            yield line
        last["generated_text"] = _generated_text(req, "".join(text_parts))
        if req.output.details:
            final = event.deltas[-1] if event.deltas else TokenDelta()
            details: dict[str, Any] = {
                "finish_reason": finish_reason(final.finish_reason, final.stop_reason),
                "generated_tokens": generated,
                "inputs": req.prompt,
            }
            if req.dialect == TGI:
                details.update(input_length=event.usage.prompt_tokens, seed=req.sampling.seed)
            last["details"] = details
        yield last
        return


async def render_batch_stream(inputs: int, events: AsyncIterator[Event | Keepalive]) -> AsyncIterator[bytes]:
    """Dynamic-batch streaming: ``{"outputs": [...]}`` lines, one entry per input (its new text)."""
    try:
        async for event in events:
            if isinstance(event, Keepalive):
                continue
            if isinstance(event, Error):
                yield jsonline({"code": 424, "message": "invoke handler failure", "error": event.message})
                return
            outputs = [""] * inputs
            for delta in event.deltas:
                outputs[delta.index] += delta.text
            if any(outputs):
                yield jsonline({"outputs": outputs})
    except ServiceError as exc:
        yield jsonline({"code": 424, "message": "invoke handler failure", "error": exc.message})
