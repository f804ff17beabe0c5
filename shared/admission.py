"""Admission: what a job is given when it is queued, beyond what its request says.

:func:`new_job` is the one way a job about to be queued is made: the API's submit path
(api/submit.py), the console's requeue of a dead letter (api/routes/overview.py) and a batch's lines
(workers/housekeeping/batches.py) all call it. The policy lives here rather than in the record's
schema (``JobRecord.new`` only builds the record from what it is given):

- the deadline: the request's own ``timeout_s``, else the caller's default (the server's
  ``LLMQ_DEADLINE_S``, a batch's window), else none;
- the estimate its tenant is charged when it is picked, cut to the engine's context
  (:func:`~shared.schemas.estimate_tokens`);
- its first-token deadline, from its TTFT SLO (the pick orders by it, and skips it once passed);
- its prefix key, which the pick uses to keep a conversation on one worker (shared/affinity.py).
"""

from __future__ import annotations

import time

from shared.affinity import prefix_key
from shared.schemas import GenerationRequest, JobRecord, estimate_tokens

__all__ = ["new_job", "deadline_ms", "first_token_deadline_ms"]


def new_job(req: GenerationRequest, *, owner: str, default_timeout_s: float | None, now_ms: float | None = None,
            tenant: str = "", traceparent: str | None = None, max_model_len: int | None = None) -> JobRecord:
    """The record of a job about to be queued: queued ``now_ms`` (default: now), due as
    :func:`deadline_ms` says. ``max_model_len``: the context its estimate is cut to."""
    queued_at = round(time.time() * 1000, 3) if now_ms is None else now_ms
    return JobRecord.new(req, owner=owner, tenant=tenant, queued_at=queued_at, traceparent=traceparent,
                         deadline=deadline_ms(req, queued_at, default_timeout_s),
                         estimate=estimate_tokens(req, max_model_len), affinity=prefix_key(req, req.cache_key),
                     first_token_deadline=first_token_deadline_ms(req, queued_at))


def deadline_ms(req: GenerationRequest, queued_at: float, default_timeout_s: float | None) -> float | None:
    """Epoch ms by which a job queued at ``queued_at`` must be finished: ``req.timeout_s`` seconds
    later, else ``default_timeout_s`` (None or 0: no deadline)."""
    timeout_s = req.timeout_s or default_timeout_s
    return queued_at + timeout_s * 1000 if timeout_s else None


def first_token_deadline_ms(req: GenerationRequest, queued_at: float) -> float | None:
    """Epoch ms by which a job queued at ``queued_at`` must have sent its first token: its TTFT SLO
    later (None: it has none)."""
    ttft_ms = req.slo.ttft_ms if req.slo is not None else None
    return queued_at + ttft_ms if ttft_ms else None
