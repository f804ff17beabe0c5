"""Which of a full worker's running jobs may give way to a waiting job: the decision, with no I/O.

A worker with no free slot, while jobs wait, offers some of its running jobs to ``preempt.lua``,
which swaps one for a waiting job owed a slot by the fair share (docs/tenants.md#preemption). This
module says which jobs to offer, and when to ask again; the runner (workers/runner.py) does the
asking, the swap and the waiting. Preemption costs the job given way its engine work since its
start (its successor continues from its published tokens, re-reading them as prompt), so the rules
below keep that cost low and keep jobs from thrashing:

- a job may give way only if it has a tenant (fairness is between tenants), is not a beam search
  (which publishes only at its end: nothing to continue from) and was preempted fewer than
  LLMQ_PREEMPT_MAX times (:func:`may_give_way`, decided as it starts);
- it is offered only after LLMQ_PREEMPT_MIN_RUN_MS in this start and LLMQ_PREEMPT_MIN_TOKENS
  generated in it, its claim confirmed: every start buys some progress for its prefill;
- of each tenant's jobs at one level, only the one preempted least often, then the cheapest to
  resume (the fewest tokens to compute again), is offered: the script takes at most one job a
  tenant and level would give anyway.

Nothing here touches Redis, asyncio or the clock: the runner passes what it knows of each running
job (:class:`RunningJob`) and the loop's time. Tested step by step, as workers/attempt.py is
(tests/unit/test_preemption.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.scripts import Candidate

if TYPE_CHECKING:
    from shared.config import Settings
    from shared.queue import Delivery, Held
    from workers.attempt import Attempt

__all__ = ["PREEMPT_POLL_S", "RunningJob", "candidates", "may_give_way"]

PREEMPT_POLL_S = 0.02
"""How often a full worker asks again whether a running job should give way, while jobs wait
(preempt.lua: one short script): a light tenant's job waits at most this long for its swap."""


def may_give_way(d: Delivery, settings: Settings) -> bool:
    """Whether job ``d``, as it starts, may ever give way in this start: it has a tenant, is not a
    beam search (nothing published to continue from) and was preempted fewer than
    LLMQ_PREEMPT_MAX times."""
    return (bool(d.tenant) and d.request is not None and d.request.sampling.beam_width == 1
            and d.preemptions < settings.preempt_max)


@dataclass(frozen=True, slots=True)
class RunningJob:
    """What the decision reads of one running job that may give way (and is not stopping)."""

    job_id: str
    held: Held
    tenant: str
    started: float
    """The event loop's time at its start, in seconds."""
    preemptions: int
    """How often it was preempted before this start."""
    confirmed: bool
    """Its claim is confirmed (a fresh job starts in the engine before it is: ``Worker._start_confirming``)."""
    attempt: Attempt | None
    """Its attempt once its task runs (None: not started yet): what it generated, and costs to resume."""


def candidates(running: Iterable[RunningJob], now: float,
               settings: Settings) -> tuple[list[Candidate], float | None]:
    """The jobs of ``running`` that may give way at ``now`` (the loop's time): per tenant and level
    the one preempted least often, then cheapest to resume, past LLMQ_PREEMPT_MIN_RUN_MS and
    LLMQ_PREEMPT_MIN_TOKENS in this start, its claim confirmed; and the seconds until another may
    (None: none will)."""
    min_run_s = settings.preempt_min_run_ms / 1000
    cheapest: dict[tuple[str, int], tuple[tuple[int, int], Candidate]] = {}
    soonest: float | None = None
    for r in running:
        attempt = r.attempt
        wait = min_run_s - (now - r.started)
        if wait <= 0 and (attempt is None or not r.confirmed
                          or attempt.usage.completion_tokens - attempt.carried < settings.preempt_min_tokens):
            wait = PREEMPT_POLL_S  # not started, or not confirmed, or too few tokens yet: soon
        if wait > 0:
            soonest = wait if soonest is None else min(soonest, wait)
            continue
        assert attempt is not None
        usage = attempt.usage
        cost = (r.preemptions, usage.prompt_tokens + usage.completion_tokens)
        key = (r.tenant, r.held.level)
        if key not in cheapest or cost < cheapest[key][0]:
            cheapest[key] = (cost, Candidate(r.job_id, r.held.entry_id, r.held.attempt, r.held.level,
                                             usage.prompt_tokens, usage.completion_tokens))
    return [c for _, c in cheapest.values()], soonest
