"""The worker's spans of one job delivery, in the trace of the request that queued it.

The parent is the API's span of that request: its ``traceparent`` is in the job record and comes
back with the claim (claim.lua). A job queued without one (a batch line, an LMTP socket) starts a
trace of its own here. Per delivery:

- ``llmq.queue``: from the enqueue to this claim; only for the delivery that first takes the job
  off the queue (attempt 1), whatever it found (``llmq.outcome``: run, cancelled, expired, ...).
- ``llmq.attempt``: this worker's run of the job, from the claim to its terminal event (or its
  release: a peer took it, or it was handed back). A job continued after a crash has one per
  attempt in the same trace.
- a lost attempt, reconstructed: a process that was SIGKILLed never ended (so never exported) its
  attempt span. The worker that takes its job over knows whose it was and when it started (the
  claim returns them) and exports it, ended at the takeover, with ``llmq.outcome=worker_lost``.
- ``llmq.engine``: the engine run, child of the attempt; vLLM's own ``llm_request`` span is its
  child through the engine request's ``trace_headers``.

Attributes name the job, model, dialect, tenant, tokens, finish reasons and error code; never the
prompt or any generated text.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from shared import tracing as t
from shared.queue import Delivery
from shared.schemas import JobResult, Usage
from shared.tracing import Tracing

__all__ = ["JobSpans"]


def _ns(epoch_ms: float) -> int:
    return int(epoch_ms * 1_000_000)


class JobSpans:
    """The spans of one delivery; every method is a no-op once the attempt has ended."""

    __slots__ = ("tracing", "attempt", "engine", "common", "trace_id")

    def __init__(self, tracing: Tracing, d: Delivery, model: str, worker: str) -> None:
        self.tracing = tracing
        tracer = tracing.tracer
        parent = t.parent_context(d.traceparent)
        now = time.time_ns()
        self.common: dict[str, str | int] = {t.JOB_ID: d.job_id, t.MODEL: model, "llmq.level": d.level}
        if d.tenant:
            self.common[t.TENANT] = d.tenant
        if d.request is not None:
            self.common[t.DIALECT] = d.request.dialect
        made: list[Span] = []

        def start(name: str, start_ns: int, attributes: dict) -> Span:
            # A job queued without trace context (a batch line, an LMTP socket): this delivery's
            # first span is the root of a trace of its own, and the parent of the rest.
            context = parent if parent is not None or not made else set_span_in_context(made[0])
            span = tracer.start_span(name, context=context, kind=SpanKind.CONSUMER, start_time=start_ns,
                                     attributes={**self.common, **attributes})
            made.append(span)
            return span

        if d.attempt == 1:
            start("llmq.queue", _ns(d.queued_at), {"llmq.worker": worker, "llmq.outcome": d.state}).end(end_time=now)
        if d.lost_worker and d.lost_started:
            lost = start("llmq.attempt", _ns(d.lost_started), {
                "llmq.attempt": d.attempt - 1, "llmq.worker": d.lost_worker, "llmq.outcome": "worker_lost",
                "llmq.reconstructed": True, t.ERROR_TYPE: "worker_lost"})
            lost.set_status(Status(StatusCode.ERROR, "the worker died or stalled; a peer took the job over"))
            lost.end(end_time=now)
        self.attempt: Span | None = None
        self.engine: Span | None = None
        if d.state == "run":
            self.attempt = start("llmq.attempt", now, {"llmq.attempt": d.attempt, "llmq.worker": worker,
                                                       "llmq.resumed_after_seq": d.last_seq})
        self.trace_id = t.trace_id_of(made[0]) if made else ""

    def engine_started(self) -> dict[str, str] | None:
        """The engine span begins; returns the ``trace_headers`` for vLLM's request."""
        if self.attempt is None:
            return None
        self.engine = self.tracing.tracer.start_span(
            "llmq.engine", context=set_span_in_context(self.attempt), attributes={t.MODEL: self.common[t.MODEL]})
        return {t.TRACEPARENT: t.traceparent_of(self.engine)}

    def ended(self, outcome: str, usage: Usage, result: JobResult | None = None) -> None:
        """``outcome``: ``done``, an error code, ``released`` (a peer owns the job now) or
        ``preempted`` (it gave its slot to a job owed it, and waits to continue)."""
        if self.attempt is None:
            return
        counts = {t.INPUT_TOKENS: usage.prompt_tokens, t.OUTPUT_TOKENS: usage.completion_tokens}
        if self.engine is not None:
            self.engine.set_attributes(counts)
            self.engine.end()
        span, self.attempt, self.engine = self.attempt, None, None
        span.set_attributes({**counts, "llmq.outcome": outcome})
        if result is not None:
            span.set_attribute(t.FINISH_REASONS, [c.finish_reason or "" for c in result.choices])
            # How many calls, never their names or arguments (they can quote the conversation).
            span.set_attribute(t.TOOL_CALLS, sum(len(c.tool_calls or ()) for c in result.choices))
        elif outcome not in ("released", "preempted"):  # the job goes on elsewhere: not an error
            span.set_attribute(t.ERROR_TYPE, outcome)
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()

