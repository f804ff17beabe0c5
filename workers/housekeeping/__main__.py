"""``python -m workers.housekeeping``: the arq process for cron and retryable background work.

The hot path never goes through arq (it polls a sorted set). This process delivers webhooks
(:mod:`.webhooks`), runs batch files (:mod:`.batches`) and runs the sweeps (:mod:`.sweeps`): it
prunes expired worker registrations, deletes consumers of dead workers once they hold nothing, and
logs each model's queue depth, lag, pending count, orphaned jobs and dead letters. It does not
reclaim jobs itself (:mod:`.sweeps` says why).

Every task takes one typed :class:`~.housekeeper.Housekeeper` (settings, clients, the queue), built
once at start-up and kept in arq's ``ctx`` under one key; only the arq entry points here touch ``ctx``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import structlog
from arq import cron, func
from arq.worker import Worker, get_kwargs

from shared.browse import SAMPLE_S
from shared.config import settings_or_exit
from shared.keys import Keys
from shared.logging import configure_logging
from shared.redis import REDIS_DOWN, connect, wait_for_redis
from workers.housekeeping.arq_settings import arq_redis_settings
from workers.housekeeping.batches import advance_batches
from workers.housekeeping.housekeeper import Housekeeper
from workers.housekeeping.sweeps import sample_history, sweep
from workers.housekeeping.webhooks import DELIVER, deliver_webhook, drain_outbox

log = structlog.get_logger()


# --- arq's entry points: each takes the Housekeeper out of ctx once ---------------------------------

HOUSEKEEPER = "housekeeper"


async def startup(ctx: dict[str, Any]) -> None:
    # ctx["redis"] is arq's own client as arq hands it over; ctx["settings"] is what main() passed.
    ctx[HOUSEKEEPER] = Housekeeper.open(ctx["settings"], ctx["redis"])


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx[HOUSEKEEPER].close()


async def _sweep(ctx: dict[str, Any]) -> dict[str, int | float]:
    return await sweep(ctx[HOUSEKEEPER])


async def _sample(ctx: dict[str, Any]) -> None:
    await sample_history(ctx[HOUSEKEEPER])


async def _drain_outbox(ctx: dict[str, Any]) -> int:
    return await drain_outbox(ctx[HOUSEKEEPER])


async def _advance_batches(ctx: dict[str, Any]) -> None:
    await advance_batches(ctx[HOUSEKEEPER])


async def _deliver_webhook(ctx: dict[str, Any], model: str, job_id: str) -> str:
    return await deliver_webhook(ctx[HOUSEKEEPER], model, job_id, job_try=ctx["job_try"])


class WorkerSettings:
    functions: list = []  # built from Settings in main()
    # Named as the tasks are (arq names a job after its function): the log lines say cron:sweep.
    cron_jobs = [
        cron(_sweep, name="cron:sweep", second={0, 30}, run_at_startup=True),
        cron(_sample, name="cron:sample", second=set(range(0, 60, SAMPLE_S)), run_at_startup=True),
        cron(_drain_outbox, name="cron:drain_outbox", second=set(range(60)), run_at_startup=True),
        cron(_advance_batches, name="cron:advance_batches", second=set(range(60)), run_at_startup=True),
    ]
    on_startup = startup
    on_shutdown = shutdown
    max_jobs = 64  # webhook deliveries mostly wait on the network


class _Worker(Worker):
    """arq's worker, whose poll loop outlasts a Redis outage. arq's own loop lets any error of a
    poll (its queue read, its cron enqueues, a job's failed bookkeeping re-raised) end the
    process, and arq's Sentinel client retries nothing: a primary killed, the few seconds before
    the Sentinels name another, stopped housekeeping for good. Here a poll that finds Redis away
    logs it and waits (backing off, at most 5 s); the next one reconnects, and a Sentinel client
    asks the Sentinels for the primary again."""

    _down_delay_s = 0.0

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except REDIS_DOWN as exc:
            self._down_delay_s = min(max(self._down_delay_s * 2, 0.1), 5.0)
            log.warning("redis_unreachable", process="housekeeping", retry_in_s=self._down_delay_s, error=str(exc))
            await asyncio.sleep(self._down_delay_s)
        else:
            self._down_delay_s = 0.0


# arq logs every job's start and finish at info: with the crons that run every second, an idle
# housekeeper printed four lines a second. Here they are debug lines; arq's failures and llmq's
# own lines (webhook_delivered, webhook_retry, batch_finished) stay at info.
_ARQ_JOB_LINES = frozenset({"%6.2fs → %s(%s)%s", "%6.2fs ← %s ● %s", "%6.2fs ↻ %s retrying job in %0.2fs"})


def _demote_arq_job_lines(record: logging.LogRecord) -> bool:
    if record.msg in _ARQ_JOB_LINES:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)
    return True


def main() -> None:
    settings = settings_or_exit()
    configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    logging.getLogger("arq.worker").addFilter(_demote_arq_job_lines)

    async def ready() -> None:
        redis = connect(settings.redis_dsn)
        await wait_for_redis(redis, what="housekeeping")
        await redis.aclose()

    asyncio.run(ready())
    _Worker(**{  # arq's run_worker(), with the worker above
        **get_kwargs(WorkerSettings),  # type: ignore[arg-type]
        "functions": [func(_deliver_webhook, name=DELIVER, max_tries=settings.webhook_max_tries)],
        "redis_settings": arq_redis_settings(settings.arq_redis_dsn),
        "queue_name": Keys(settings.prefix).arq_queue(),
        "ctx": {"settings": settings},
    }).run()


if __name__ == "__main__":
    main()
