"""Webhook delivery, run by the housekeeping process through arq.

The script that ends a job (``flush.lua``, ``expire.lua``) also appends its id to the model's
webhook outbox when the job carries a webhook, so a finished job's webhook cannot be forgotten
by a crash. Every second :func:`drain_outbox` turns outbox entries into arq jobs whose id is
derived from the job id, then deletes the entries. If it dies in between, the next run enqueues
the same ids again and arq refuses the duplicates, so each job gets one delivery job (idempotent
by job id). :func:`deliver_webhook` POSTs the job, signed (shared/webhooks.py), and retries with
exponential backoff through arq's ``Retry`` on connection errors, timeouts, 408, 425, 429 and
5xx. Any other answer is final, a redirect included (it is not followed). The outcome is written
to the job record (``webhook_status``, ``webhook_attempts``), so ``GET /v1/jobs/{id}`` and
redis-cli show it.

Each attempt first resolves the URL's host and checks every address against
``LLMQ_WEBHOOK_ALLOW`` (shared/egress.py), then connects to the address it checked: the API
checked at submit too, but a name can resolve elsewhere by now (DNS rebinding). A refused
destination is final: ``webhook_status=failed`` at once, no retries.
"""

from __future__ import annotations

import httpx
import structlog
from arq import Retry

from shared.codec import encode
from shared.egress import Refused, pin, policy
from shared.schemas import JobView
from shared.webhooks import headers
from workers.housekeeping.housekeeper import Housekeeper

__all__ = ["drain_outbox", "deliver_webhook", "backoff_s", "DELIVER"]

log = structlog.get_logger()

OUTBOX_BATCH = 500
RETRYABLE = {408, 425, 429}
MAX_BACKOFF_S = 300.0
DELIVER = "deliver_webhook"
"""The arq function name of a delivery (the process module, ``__main__``, registers it)."""


def backoff_s(job_try: int, retry_after: str | None = None) -> float:
    """1, 2, 4 ... seconds, at most 5 min; a receiver's Retry-After (seconds) wins within that cap."""
    if retry_after and retry_after.isdigit():
        return min(float(retry_after), MAX_BACKOFF_S)
    return min(2.0 ** (job_try - 1), MAX_BACKOFF_S)


async def drain_outbox(hk: Housekeeper) -> int:
    """Move every model's outbox entries into arq delivery jobs; returns how many were moved."""
    keys, redis = hk.keys, hk.redis
    moved = 0
    for raw in await redis.zrange(keys.models(), 0, -1):
        model = raw.decode()
        outbox = keys.webhooks(model)
        entries = await redis.xrange(outbox, count=OUTBOX_BATCH)
        for _, fields in entries:
            job_id = fields[b"job"].decode()
            # A repeat (this entry moved before, then a crash before the XDEL) is refused by arq.
            await hk.arq.enqueue_job(DELIVER, model, job_id, _job_id=keys.webhook_delivery(job_id))
        if entries:
            await redis.xdel(outbox, *(entry_id for entry_id, _ in entries))
            moved += len(entries)
    return moved


async def deliver_webhook(hk: Housekeeper, model: str, job_id: str, *, job_try: int) -> str:
    """One delivery attempt (``job_try``, from 1): the outcome, or :class:`arq.Retry` to try again."""
    settings, queue = hk.settings, hk.queue
    bound = log.bind(job_id=job_id, model=model, attempt=job_try)
    record = await queue.get_job(model, job_id)
    if record is None or not record.webhook:
        bound.warning("webhook_job_gone")  # its record expired before delivery: nothing to send
        return "gone"
    if record.webhook_status is not None:
        return record.webhook_status  # a duplicate delivery job: the outcome is already final
    body = encode(JobView.of(record, record.result))
    retry_after = None
    try:
        target = await pin(policy(settings.webhook_allow), record.webhook, timeout_s=settings.webhook_timeout_s)
        answer = await hk.http.post(target.url, content=body, follow_redirects=False,
                                        headers={**headers(settings.webhook_secret, job_id, body), **target.headers},
                                        extensions=target.extensions)
    except Refused as exc:
        # Final: the destination will not become allowed by waiting. No URL in the log, as it
        # may carry the receiver's credentials; the reason names the host.
        await queue.note(model, job_id, {"webhook_status": "failed", "webhook_attempts": job_try})
        bound.warning("webhook_refused", reason=exc.message, address=str(exc.address) if exc.address else None)
        return "failed"
    except (httpx.HTTPError, OSError, TimeoutError) as exc:  # OSError, TimeoutError: the lookup
        outcome, retryable = f"{type(exc).__name__}: {exc}", True
    else:
        outcome = str(answer.status_code)
        retryable = answer.status_code in RETRYABLE or answer.status_code >= 500
        retry_after = answer.headers.get("retry-after")
        if answer.is_success:
            await queue.note(model, job_id, {"webhook_status": "delivered", "webhook_attempts": job_try})
            bound.info("webhook_delivered", status=answer.status_code)
            return "delivered"
    if retryable and job_try < settings.webhook_max_tries:
        await queue.note(model, job_id, {"webhook_attempts": job_try})
        delay = backoff_s(job_try, retry_after)
        bound.info("webhook_retry", outcome=outcome, retry_in_s=delay)
        raise Retry(defer=delay)
    await queue.note(model, job_id, {"webhook_status": "failed", "webhook_attempts": job_try})
    bound.warning("webhook_failed", outcome=outcome, final=True)
    return "failed"
