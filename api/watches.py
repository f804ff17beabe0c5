"""Cancel on disconnect: the jobs a request follows live only as long as the request.

Every job a request submits (not fire-and-poll ones) is watched by that request (:class:`JobWatch`,
registered before the enqueue awaits). When the request ends (the response is done, the client
disconnected, the LMTP socket closed) any watched job whose terminal event was not relayed is
cancelled; the worker aborts it in the engine. Ending early is the only trigger: a job that
finished is never cancelled, whoever reads it later. The request's set of watches is created and
ended by :class:`api.middleware.RequestLifecycle` and reaches :func:`api.submit.submit` in the request's
context.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass

import structlog

from api.services import Services
from shared.redis import REDIS_DOWN

__all__ = ["JobWatch", "cancel_quietly", "end_watches"]

log = structlog.get_logger()


@dataclass(eq=False, slots=True)
class JobWatch:
    """A job that lives only as long as the request that submitted it."""

    svc: Services
    model: str
    job_id: str
    stack: AsyncExitStack
    finished: bool = False  # its terminal event was relayed (or it was already cancelled)
    scope: set[JobWatch] | None = None  # the request's watches, left once the relay is closed

    def cancel(self) -> asyncio.Task[None] | None:
        """Cancel the job (in the background: this may run inside a cancelled scope)."""
        if self.finished:
            return None
        self.finished = True
        return self.svc.spawn(cancel_quietly(self.svc, self.model, self.job_id))


async def cancel_quietly(svc: Services, model: str, job_id: str) -> None:
    """Cancel a job nobody will follow; a Redis outage is logged, not raised (runs in the background)."""
    try:
        status = await svc.queue.cancel(model, job_id)
    except REDIS_DOWN as exc:
        log.warning("cancel_on_disconnect_failed", job_id=job_id, error=str(exc))
        return
    if status in ("queued", "running"):
        log.info("job_cancelled_on_disconnect", job_id=job_id, model=model, was=status)


async def end_watches(watches: set[JobWatch]) -> None:
    """The request is over: cancel its unfinished jobs, release subscriptions nobody closed."""
    pending = list(watches)
    tasks = [t for t in (w.cancel() for w in pending) if t is not None]
    for w in pending:
        await w.stack.aclose()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
