"""``python -m workers.housekeeping``: the arq process for cron and retryable background work.

The hot path never goes through arq (it polls a sorted set). This process delivers webhooks
(workers/webhooks.py), runs batch files (workers/batches.py) and runs sweeps: it prunes
expired worker registrations, deletes consumers of dead workers once they hold nothing, and
logs each model's queue depth, lag, pending count, orphaned jobs and dead letters.

It does not reclaim jobs itself. Taking over a job means running it, which needs an engine; an
entry claimed here would only have to be claimed again by a worker, and "claimed but not yet
running" is exactly the state a crash must not leave behind. So live workers reclaim (before
every read, while they have free slots), and this sweep reports what waits for them: entries
whose lease lapsed (``orphaned``) and how old the oldest is, the number to alert on when no
worker has room or none is alive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import httpx
import structlog
from arq import cron, func
from arq.connections import RedisSettings
from arq.worker import run_worker
from redis.exceptions import ResponseError

from shared.config import MASK, Settings, load_settings
from shared.keys import GROUP, Keys
from shared.logging import configure_logging
from shared.queue import Queue, now_ms
from shared.redis import connect, wait_for_redis
from workers.batches import advance_batches
from workers.webhooks import deliver_webhook, drain_outbox

log = structlog.get_logger()


async def sweep(ctx: dict[str, Any]) -> dict[str, int]:
    settings: Settings = ctx["settings"]
    keys: Keys = ctx["keys"]
    redis = ctx["redis"]
    model = settings.model_name
    pruned = await redis.zremrangebyscore(keys.workers(model), 0, now_ms())
    stats: dict[str, int | float] = {"ready_workers": await redis.zcard(keys.workers(model)),
                                     "pruned_workers": pruned, "pending": 0, "lag": 0, "queued": 0}
    for queue in keys.queues(model):  # every priority level, summed
        try:
            for group in await redis.xinfo_groups(queue):
                if group["name"].decode() == GROUP:
                    stats["pending"] += group["pending"]
                    stats["lag"] += group.get("lag") or 0
        except ResponseError:  # no queue yet
            pass
        stats["queued"] += await redis.xlen(queue)
        for name, value in (await _orphans_and_consumers(redis, keys, queue, settings)).items():
            stats[name] = max(stats.get(name, 0), value) if name == "oldest_orphan_s" else stats.get(name, 0) + value
    stats["dead_letters"] = await redis.xlen(keys.dead(model))
    # Every 30 s: at info only the first time and when something changed that an operator acts on
    # (workers came or went, jobs wait orphaned, dead letters); the rest is in /metrics anyway.
    # (arq gives each run a copy of ctx: the figures seen last live in the dict startup put there.)
    last = ctx.setdefault("last_sweep", {})
    notable = tuple(stats.get(k, 0) for k in ("ready_workers", "orphaned", "dead_letters"))
    changed = notable != last.get(model) or stats["pruned_workers"] or stats.get("consumers_removed")
    last[model] = notable
    (log.info if changed else log.debug)("housekeeping_sweep", model=model, **stats)
    return stats


# A consumer this idle, holding nothing, whose worker's heartbeat key is gone, belongs to a dead
# worker (consumer names are worker ids). The heartbeat check is what protects a live worker.
STALE_CONSUMER_MS = 10 * 60 * 1000


async def _orphans_and_consumers(redis, keys: Keys, queue: str, settings: Settings) -> dict[str, int | float]:
    lease_ms = int(settings.lease_s * 1000)
    try:
        orphans = await redis.xpending_range(queue, GROUP, min="-", max="+", count=1000, idle=lease_ms)
        consumers = await redis.xinfo_consumers(queue, GROUP)
    except ResponseError:  # no queue or group yet
        return {}
    removed = 0
    for consumer in consumers:
        name = consumer["name"]
        # DELCONSUMER discards the consumer's pending entries: only ever for one that holds none.
        if consumer["pending"] == 0 and consumer["idle"] > STALE_CONSUMER_MS:
            if not await redis.exists(keys.worker(name.decode())):
                removed += await redis.xgroup_delconsumer(queue, GROUP, name) == 0
    oldest = max((o["time_since_delivered"] for o in orphans), default=0)
    return {"orphaned": len(orphans), "oldest_orphan_s": round(oldest / 1000, 1), "consumers_removed": removed}


class _RedisSettings(RedisSettings):
    """arq's settings, with a repr that masks the password (arq's own shows it)."""

    def __repr__(self) -> str:
        shown = {**self.__dict__, "password": MASK if self.password else self.password}
        return f"RedisSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def arq_redis_settings(dsn: str) -> RedisSettings:
    """arq's connection settings for the same URL llmq's own clients use. arq's ``from_dsn``
    drops the query (a private CA's ``ssl_ca_certs``, ``ssl_check_hostname``, ...) and keeps a
    percent-encoded password encoded; redis-py reads both, so llmq does too."""
    from_dsn = RedisSettings.from_dsn(dsn)
    base = _RedisSettings(**{f.name: getattr(from_dsn, f.name) for f in dataclasses.fields(from_dsn)})
    url = urlparse(dsn)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    changes: dict[str, Any] = {"username": unquote(url.username) if url.username else None,
                               "password": unquote(url.password) if url.password else None}
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
        if name in query:
            changes[name] = query[name]
    if "ssl_check_hostname" in query:
        changes["ssl_check_hostname"] = query["ssl_check_hostname"].lower() in ("1", "true", "yes", "on")
    return dataclasses.replace(base, **changes)


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    ctx["keys"] = keys = Keys(settings.prefix)
    ctx["last_sweep"] = {}  # model -> the figures its last sweep logged
    # arq's own client (ctx["redis"] as arq hands it over) enqueues arq jobs; the one that
    # replaces it reads llmq's keys (bytes, our timeouts).
    ctx["arq"] = ctx["redis"]
    ctx["redis"] = redis = connect(settings.redis_dsn)
    ctx["queue"] = Queue(redis, keys, result_ttl_s=settings.result_ttl_s)
    # Redirects are not followed: a webhook URL is where the signed result goes, nowhere else.
    ctx["http"] = httpx.AsyncClient(timeout=settings.webhook_timeout_s, follow_redirects=False)


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["http"].aclose()
    await ctx["redis"].aclose()


class WorkerSettings:
    functions: list = []  # built from Settings in main()
    cron_jobs = [
        cron(sweep, second={0, 30}, run_at_startup=True),
        cron(drain_outbox, second=set(range(60)), run_at_startup=True),
        cron(advance_batches, second=set(range(60)), run_at_startup=True),
    ]
    on_startup = startup
    on_shutdown = shutdown
    max_jobs = 64  # webhook deliveries mostly wait on the network


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
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    logging.getLogger("arq.worker").addFilter(_demote_arq_job_lines)

    async def ready() -> None:
        redis = connect(settings.redis_dsn)
        await wait_for_redis(redis, what="housekeeping")
        await redis.aclose()

    asyncio.run(ready())
    run_worker(
        WorkerSettings,  # type: ignore[arg-type]
        functions=[func(deliver_webhook, max_tries=settings.webhook_max_tries)],
        redis_settings=arq_redis_settings(settings.arq_redis_dsn),
        queue_name=Keys(settings.prefix).arq_queue(),
        ctx={"settings": settings},
    )


if __name__ == "__main__":
    main()
