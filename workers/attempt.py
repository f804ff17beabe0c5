"""One attempt at a job: its engine steps turned into events, with no I/O.

The worker (workers/runner.py) feeds each engine step of a job to :meth:`Attempt.on_step` and
writes what comes back, and ends an attempt that failed with :meth:`Attempt.end`. Each event is
encoded once, here: the same bytes go to the log, the live path and, at the job's end, its compact
log (which once encoded every event a second time). A token event is encoded straight from its
deltas (:func:`tokens_json`), with no event object per token. Nothing here
touches Redis, asyncio or the metrics: what the worker records (tokens, the first token's time)
and what the outbox writes with an event (the prompt's ids, the result, the compact log) come back
in the :class:`Emission`. Tested step by step like LMTP's ``TokenStream.feed``
(tests/unit/test_attempt.py).

A step may join the attempt's last token event instead of making one (``on_step``'s ``join``: the
job's dialect reads merged deltas as the separate ones, shared/chunking.py), while that event is
still *open*: the worker's outbox has not sealed it (workers/outbox.py). The event is then encoded
again once, when the outbox seals it (:meth:`Attempt.sealed`, which closes it), not per step
(tests/unit/test_merged_events.py). So the worker crosses into the attempt once per step
(``on_step``) and gets one :class:`Emission` back; whether a step may still join is the attempt's
own state, not a question the worker asks each step.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

from shared import eventlog
from shared.codec import decode_event, encode
from shared.errors import ServiceError
from shared.events import LOGPROB_FLOOR, Done, Error, Event, Timings, TokenDelta, Tokens, ToolCallDelta
from shared.result import ResultBuilder
from shared.schemas import JobResult, PromptInfo, TopLogprob, Usage
from workers.protocol import Step

__all__ = ["Attempt", "Emission", "finite_logprobs", "merge_deltas", "tokens_json"]


def tokens_json(seq: int, deltas: list[TokenDelta]) -> bytes:
    """``encode(Tokens(seq=seq, deltas=deltas))``, byte for byte (the tag first, then the fields in
    order, defaults left out: a prompt-less event has no ``prompt``), without building the event."""
    return b'{"type":"tokens","seq":%d,"deltas":%b}' % (seq, encode(deltas))

def _finite(values: list, floor: float = LOGPROB_FLOOR) -> list:
    """``values`` (floats, or None for a prompt's first token) with every NaN and infinity as
    ``floor``; the same list when all are finite, as nearly always."""
    if all(v is None or math.isfinite(v) for v in values):
        return values
    return [v if v is None or math.isfinite(v) else floor for v in values]


def _finite_tops(tops: list[list[TopLogprob]]) -> list[list[TopLogprob]]:
    """Each position's alternatives, as :func:`_finite` (the same list when all are finite)."""
    if all(math.isfinite(t.logprob) for position in tops for t in position):
        return tops
    return [[t if math.isfinite(t.logprob) else TopLogprob(t.id, t.text, LOGPROB_FLOOR) for t in position]
            for position in tops]


def finite_logprobs(step: Step) -> None:
    """Make every logprob of ``step`` one JSON can carry (``LOGPROB_FLOOR``), in place: the
    sampled tokens', their alternatives', the prompt's. The one place every engine's logprobs pass
    on their way into an event, so every dialect renders a number."""
    for delta in step.deltas:
        if delta.logprobs is not None:
            delta.logprobs = _finite(delta.logprobs)
        if delta.top_logprobs is not None:
            delta.top_logprobs = _finite_tops(delta.top_logprobs)
    prompt: PromptInfo | None = step.prompt
    if prompt is not None:
        if prompt.logprobs is not None:
            prompt.logprobs = _finite(prompt.logprobs)
        if prompt.top_logprobs is not None:
            prompt.top_logprobs = _finite_tops(prompt.top_logprobs)


# What a delta holds, in the order every dialect renders one delta's parts (reasoning, then text,
# then tool calls): a merge never puts a later step's part before an earlier step's.
_REASONING, _TEXT, _CALLS = 0, 1, 2


def _kinds(delta: TokenDelta) -> list[int]:
    return [k for k, present in ((_REASONING, delta.reasoning), (_TEXT, delta.text), (_CALLS, delta.tool_calls))
            if present]


def _joined(first: list | None, then: list | None, first_tokens: int, then_tokens: int) -> tuple[bool, list | None]:
    """A per-token list (logprobs, their texts, their alternatives) of two deltas as one: (False,
    _) when one has it and the other does not for tokens of its own (they never differ in practice:
    the same request asks for the same)."""
    if first is None and then is None:
        return True, None
    if first is None:
        return (True, then) if not first_tokens else (False, None)
    if then is None:
        return (True, first) if not then_tokens else (False, None)
    return True, first + then


def _mergeable(into: TokenDelta, then: TokenDelta) -> bool:
    if into.finish_reason is not None:
        return False  # its choice ended there
    kinds = _kinds(into)
    if kinds and any(k < kinds[-1] for k in _kinds(then)):
        return False
    n, m = len(into.token_ids), len(then.token_ids)
    return all(_joined(a, b, n, m)[0] for a, b in ((into.token_texts, then.token_texts),
                                                     (into.logprobs, then.logprobs),
                                                     (into.top_logprobs, then.top_logprobs)))


def _merged(into: TokenDelta, then: TokenDelta) -> TokenDelta:
    """``into`` followed by ``then`` (the next step's delta of the same choice), as a new delta:
    the engine's are never changed (the result builder may hold their lists)."""
    n, m = len(into.token_ids), len(then.token_ids)
    calls = list(into.tool_calls)
    for call in then.tool_calls:
        last = calls[-1] if calls else None
        if last is not None and last.index == call.index and call.id is None:
            # The same call's arguments go on: one piece, as the separate pieces read back joined.
            calls[-1] = ToolCallDelta(index=last.index, id=last.id, name=last.name,
                                      arguments=last.arguments + call.arguments)
        else:
            calls.append(call)
    return TokenDelta(index=into.index, token_ids=into.token_ids + then.token_ids, text=into.text + then.text,
                      token_texts=_joined(into.token_texts, then.token_texts, n, m)[1],
                      logprobs=_joined(into.logprobs, then.logprobs, n, m)[1],
                      top_logprobs=_joined(into.top_logprobs, then.top_logprobs, n, m)[1],
                      finish_reason=then.finish_reason, stop_reason=then.stop_reason,
                      reasoning=into.reasoning + then.reasoning, tool_calls=calls)


def merge_deltas(into: list[TokenDelta], then: list[TokenDelta]) -> list[TokenDelta] | None:
    """One event's deltas followed by the next step's ``then`` as one event's, when that reads
    back as the two events would (choice by choice: the same tokens, texts, logprobs, reasoning
    and tool-call pieces, in order); None when it would not (a choice that ended, reasoning after
    text, logprobs on one side only)."""
    at = {d.index: i for i, d in enumerate(into)}
    if not all(d.index not in at or _mergeable(into[at[d.index]], d) for d in then):
        return None
    out = list(into)
    for d in then:
        if d.index in at:
            out[at[d.index]] = _merged(out[at[d.index]], d)
        else:
            at[d.index] = len(out)
            out.append(d)
    return out


@dataclass(slots=True)
class Emission:
    """One event of an attempt, with what its write carries and what the worker records."""

    data: bytes
    """The event's JSON: what the log, the live path and the compact log hold."""
    seq: int
    terminal: Done | Error | None = None
    """The event itself when it ends the job (its end writes the result or the error); a token
    event travels as ``data`` only."""
    tokens: int = 0
    """Tokens generated by the step that made it (the worker's token counter)."""
    first_token_at: float | None = None
    """Set on the event that carries a fresh job's first token: its time (and the TTFT)."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids, on the attempt's first event: stored so a successor can continue."""
    result: JobResult | None = None
    """The job's result, on its Done."""
    log: bytes | None = None
    """Terminal: the job's whole log in compact form (shared/eventlog.py), to replace its stream;
    None keeps the stream (the attempt did not write every event of the job)."""
    merged: bool = False
    """The step joined the attempt's last event (``seq``): no new event, ``data`` empty (the
    event's bytes are :meth:`Attempt.sealed`'s)."""

    @property
    def event(self) -> Event:
        """The event (a token event decoded from its bytes: for readers off the hot path)."""
        return self.terminal if self.terminal is not None else decode_event(self.data)


class Attempt:
    """One attempt at a job, fed its engine steps in order."""

    def __init__(self, *, queued_at: float, started_at: float, seq: int = 0, whole_log: bool = False) -> None:
        self.seq = self.base = seq
        """The job's last event so far; this attempt's events follow it (from ``base``)."""
        self.whole_log = whole_log
        """This attempt writes every event of the job (a fresh start), so its end may compact the log."""
        self.timings = Timings(queued_at=queued_at, started_at=started_at)
        self.usage = Usage()
        self.builder = ResultBuilder()
        self.encoded: list[bytes] = []
        """This attempt's events as JSON, seqs ``base`` + 1 on: for the compact log its end leaves,
        and to write again what a failover took back from the log."""
        self.result: JobResult | None = None
        self.carried = 0
        """Completion tokens earlier attempts published (:meth:`continues`): the rest are this one's."""
        self.fresh = True
        """No earlier attempt published a token: this one records the first token's time."""
        self._prompt_ids: list[int] | None = []  # [] = not yet known; None = nothing (more) to store
        self.logged_prompt_ids: list[int] | None = None
        """The prompt's ids this attempt's first event carried (None: it carried none), kept to
        write them again with it (the worker's refill after a failover)."""
        self._open: list[TokenDelta] | None = None
        """The deltas of the last event (``seq``) while later steps may join it, until it is
        :meth:`sealed` or a later event is made: a token event, not the attempt's first (which
        carries the prompt's ids and the first token, and opens the client's stream with what one
        step made)."""
        self._stale = False
        """Steps joined the open event since it was encoded (``encoded[-1]``)."""

    def continues(self, seq: int, builder: ResultBuilder, *, prompt_tokens: int = 0, emitted: int = 0) -> None:
        """Before the first step: earlier attempts published events up to ``seq`` (``builder``
        holds them), ``emitted`` completion tokens of them, for a prompt of ``prompt_tokens``
        (workers/continuation.py's plan)."""
        self.seq, self.base, self.builder = seq, seq, builder
        self.usage.prompt_tokens, self.usage.completion_tokens = prompt_tokens, emitted
        self.carried = emitted
        if emitted:
            # The first token's time was recorded by the first attempt, and the prompt's ids too.
            self.fresh, self._prompt_ids = False, None

    def on_step(self, step: Step, clock: Callable[[], float], join: bool = False) -> Emission | None:
        """The event one engine step makes, if any. ``clock``: the time now (epoch ms), read only
        for the first token and the end (not per step: this runs once per token). ``join``: the job's
        stream reads merged deltas as separate ones (shared/chunking.py): while the attempt's last
        event is open (not yet :meth:`sealed`: the worker's outbox has not taken it), the step's
        tokens join it when they can (:func:`merge_deltas`), its seq theirs, so one log entry and
        one live line carry them, seqs still 1..n; the event's bytes are then :meth:`sealed`'s."""
        finite_logprobs(step)
        if self.fresh:
            self.usage.prompt_tokens = step.prompt_tokens or self.usage.prompt_tokens
            if step.cached_tokens:
                self.usage.cached_tokens = step.cached_tokens
        if self._prompt_ids == []:
            self._prompt_ids = step.prompt_token_ids or (step.prompt.token_ids if step.prompt is not None else None)
        deltas = [x for x in step.deltas if x.token_ids or x.text or x.finish_reason]
        tokens = sum(len(x.token_ids) for x in deltas)
        self.usage.completion_tokens += tokens
        first_token_at = None
        if self.fresh and self.timings.first_token_at is None and self.usage.completion_tokens:
            first_token_at = self.timings.first_token_at = clock()
        if not (deltas or step.prompt or step.finished):
            return None
        if (join and self._open is not None and deltas and step.prompt is None and not step.finished
                and first_token_at is None):
            merged = merge_deltas(self._open, deltas)
            if merged is not None:
                self._open, self._stale = merged, True
                self.builder.add_deltas(deltas)
                return Emission(b"", self.seq, None, tokens, merged=True)
        self._close()
        if step.finished:
            self.timings.finished_at = clock()
            done = Done(seq=self.seq + 1, deltas=deltas, prompt=step.prompt, usage=self.usage, timings=self.timings,
                        pooled=step.pooled)
            data = self._add(done)
            self.result = self.builder.result()
            return Emission(data, done.seq, done, tokens, first_token_at, result=self.result,
                            log=self._log(self.result))
        seq = self.seq + 1
        if step.prompt is None:  # every event but perhaps the first: no event object
            data = tokens_json(seq, deltas)
            self.seq = seq
            self.builder.add_deltas(deltas)
            self.encoded.append(data)
            if seq > self.base + 1:
                self._open = deltas
        else:
            data = self._add(Tokens(seq=seq, deltas=deltas, prompt=step.prompt))
        # The prompt's ids ride the first event, so whoever sees a token in the log can also
        # continue after it.
        prompt_ids, self._prompt_ids = self._prompt_ids or None, None
        if prompt_ids is not None:
            self.logged_prompt_ids = prompt_ids
        return Emission(data, seq, None, tokens, first_token_at, prompt_ids=prompt_ids)

    def end(self, exc: ServiceError) -> Emission:
        """The terminal error event that ends the attempt (and the job) with ``exc``."""
        self._close()
        error = Error.of(exc, self.seq + 1)
        return Emission(self._add(error), error.seq, error, log=self._log())

    def sealed(self, seq: int) -> bytes:
        """The JSON of this attempt's event ``seq`` with every step that joined it; no step joins
        it after this (the worker's outbox calls it as the event is taken, or a later event of the
        job queued: workers/outbox.py)."""
        if seq == self.seq:
            self._close()
        return self.encoded[seq - self.base - 1]

    def _close(self) -> None:
        """No later step joins the open event; encoded again if steps joined it."""
        if self._stale:
            assert self._open is not None  # only steps that joined the open event make it stale
            self.encoded[-1] = tokens_json(self.seq, self._open)
            self._stale = False
        self._open = None

    def _add(self, event: Event) -> bytes:
        self.seq = event.seq
        self.builder.add(event)
        data = encode(event)
        self.encoded.append(data)
        return data

    def _log(self, result: JobResult | None = None) -> bytes | None:
        """The job's whole event log in compact form (shared/eventlog.py), which replaces its
        per-event stream as the job ends: a finished job then costs its result plus a few hundred
        bytes for LLMQ_RESULT_TTL_S, not ~180 bytes per token. Only when this attempt wrote every
        event (a fresh start): a continued job's first events came from an earlier attempt, and
        its stream is kept as it is (continuations are rare). ``result``: the one the record
        stores, which the compact form refers to rather than repeats."""
        if not self.whole_log:
            return None
        # Without the cyclic GC: compacting allocates thousands of short-lived dicts and lists
        # (all freed by refcount), and the collections they would trigger scan every live object
        # of the worker (every running job's events): measured, that doubled the cost per token.
        enabled = gc.isenabled()
        gc.disable()
        try:
            # The JSON array of the events, from their bytes: encoding them again cost as much as the first time.
            return eventlog.compact(b"[" + b",".join(self.encoded) + b"]", None if result is None else encode(result))
        finally:
            if enabled:
                gc.enable()
