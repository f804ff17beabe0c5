"""Crash continuation: turn a reclaimed job's logged events into the request that continues it.

When a worker dies mid-generation its successor does not start over (the client already holds
the first tokens): it asks the engine for the rest, with the prompt's token ids plus every token
already published as the new prompt and what is left of the token budget. For greedy decoding
the result equals an uninterrupted run; the successor's events continue the same sequence.

What cannot continue seamlessly, once tokens were published, fails with ``worker_lost``:
several choices (``n`` > 1; each choice would need its own continuation), beam search (it
publishes everything at the end, so it never has partial output and simply restarts), structured
outputs (the grammar state of the emitted prefix cannot be handed to the engine) and jobs whose
prompt token ids were never recorded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import structlog

from shared.errors import WorkerLost
from shared.events import Event, Tokens
from shared.queue import Delivery, Queue
from shared.redis import REDIS_DOWN
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest

__all__ = ["Continuation", "plan_continuation", "plan_for"]

log = structlog.get_logger()


@dataclass(slots=True)
class Continuation:
    request: GenerationRequest
    """What to give the engine: the original request, or its continuation."""
    seq: int = 0
    """The last published sequence number; new events continue from here."""
    builder: ResultBuilder = field(default_factory=ResultBuilder)
    """Already holds the published events, so the final result covers the whole job."""
    emitted: int = 0
    """Completion tokens published by earlier attempts."""
    prompt_tokens: int = 0
    """The original prompt's length (the continued prompt is longer)."""


def plan_continuation(req: GenerationRequest, prior: list[Event], prompt_ids: list[int] | None) -> Continuation:
    """The continuation of ``req`` after the token events ``prior`` (all non-terminal, in order).

    Raises :class:`WorkerLost` when the job published tokens but cannot continue seamlessly.
    """
    plan = Continuation(request=req, seq=prior[-1].seq if prior else 0)
    for event in prior:
        plan.builder.add(event)
    emitted_ids: list[int] = []
    for event in prior:
        if isinstance(event, Tokens):
            for delta in event.deltas:
                emitted_ids.extend(delta.token_ids)
    if not emitted_ids:
        return plan  # nothing but (maybe) the prompt was published: a fresh start is seamless
    s = req.sampling
    if s.n > 1 or s.beam_width > 1 or s.structured is not None:
        raise WorkerLost("the worker running this job stopped after streaming part of it, and jobs with "
                         "several choices, beam search or structured output cannot be continued")
    if prompt_ids is None:
        raise WorkerLost("the worker running this job stopped and its prompt tokens were not recorded")
    plan.emitted = len(emitted_ids)
    plan.prompt_tokens = len(prompt_ids)
    remaining = s.max_tokens - plan.emitted
    sampling = msgspec.structs.replace(
        s, max_tokens=max(remaining, 1), min_tokens=max(s.min_tokens - plan.emitted, 0),
        prompt_logprobs=None,  # already published with the first event
    )
    plan.request = msgspec.structs.replace(
        req, prompt=None, messages=None, prompt_token_ids=prompt_ids + emitted_ids, sampling=sampling,
        output=msgspec.structs.replace(req.output, prompt_tokens=False),
    )
    return plan


async def plan_for(queue: Queue, model: str, d: Delivery, req: GenerationRequest) -> Continuation:
    """A fresh start, or the continuation of what earlier attempts already published (the log
    is read until Redis answers: the job cannot start without it)."""
    if not d.last_seq:
        return Continuation(request=req)
    delay = 0.1
    while True:
        try:
            prior = await queue.read_events(model, d.job_id)
            break
        except REDIS_DOWN as exc:
            log.warning("redis_read_failed", retry_in_s=delay, error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    plan = plan_continuation(req, [e for e in prior if isinstance(e, Tokens)], d.prompt_ids)
    log.info("job_continued", after_seq=plan.seq, emitted=plan.emitted)
    return plan
