"""``python -m workers.housekeeping``: the arq process for cron and retryable background work.

The hot path never goes through arq (it polls a sorted set). This process delivers webhooks
(workers/webhooks.py), runs batch files (workers/batches.py) and runs sweeps: it prunes
expired worker registrations, deletes consumers of dead workers once they hold nothing, and
logs each model's queue depth, lag, pending count, orphaned jobs and dead letters.

Every task takes one typed :class:`Housekeeper` (settings, clients, the queue), built once at
start-up and kept in arq's ``ctx`` under one key; only the arq entry points here touch ``ctx``.

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
from arq import ArqRedis, cron, func
from arq.connections import RedisSettings
from arq.worker import Worker, get_kwargs
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.browse import SAMPLE_S, sample
from shared.config import MASK, Settings, load_settings
from shared.inspection import QueueReading, read_queue
from shared.keys import GROUP, Keys
from shared.logging import configure_logging
from shared.queue import JobStore, now_ms
from shared.redis import REDIS_DOWN, SentinelTarget, connect, sentinel_target, wait_for_redis
from shared.redis_memory import MemoryGuard
from workers.batches import advance_batches
from workers.webhooks import DELIVER, deliver_webhook, drain_outbox

log = structlog.get_logger()


@dataclasses.dataclass(slots=True)
class Housekeeper:
    """What every housekeeping task works with: built once at start-up (:meth:`open`)."""

    settings: Settings
    keys: Keys
    redis: Redis
    """llmq's own client: reads and writes llmq's keys (bytes, llmq's timeouts)."""
    queue: JobStore
    arq: ArqRedis
    """arq's client, the one arq connected: enqueues arq jobs (webhook deliveries)."""
    http: httpx.AsyncClient
    """Webhook deliveries. Redirects are not followed: a webhook URL is where the signed result
    goes, nowhere else."""
    last_sweep: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Model -> the figures its last sweep logged at info (arq hands each run a copy of ``ctx``:
    this object, not ``ctx``, is what the runs share)."""

    @classmethod
    def open(cls, settings: Settings, arq: ArqRedis) -> Housekeeper:
        keys, redis = Keys(settings.prefix), connect(settings.redis_dsn)
        return cls(settings=settings, keys=keys, redis=redis, arq=arq,
                   queue=JobStore(redis, keys, result_ttl_s=settings.result_ttl_s, usage_days=settings.usage_days,
                                  durability=settings.acknowledgement, recent_jobs=settings.recent_jobs,
                                  memory=MemoryGuard(redis, settings.redis_memory_watermark)),
                   http=httpx.AsyncClient(timeout=settings.webhook_timeout_s, follow_redirects=False))

    async def close(self) -> None:
        await self.http.aclose()
        await self.redis.aclose()


async def sweep(hk: Housekeeper) -> dict[str, int | float]:
    """Prune lapsed worker registrations, remove dead workers' empty consumers, log the figures.
    ``lag`` is the jobs not yet delivered (stream length minus pending, as /metrics has it)."""
    model = hk.settings.model_name
    pruned = await hk.redis.zremrangebyscore(hk.keys.workers(model), 0, now_ms())
    reading = await read_queue(hk.redis, hk.keys, model, now_ms=now_ms(), lease_ms=int(hk.settings.lease_s * 1000))
    levels = reading.levels  # every priority level, summed
    stats: dict[str, int | float] = {
        "ready_workers": reading.ready_workers, "pruned_workers": pruned,
        "pending": sum(lv.pending for lv in levels), "lag": sum(lv.waiting for lv in levels),
        "queued": reading.depth, "orphaned": sum(lv.orphaned for lv in levels),
        "oldest_orphan_s": round(max(lv.oldest_orphan_ms for lv in levels) / 1000, 1),
        "consumers_removed": await _remove_dead_consumers(hk, reading), "dead_letters": reading.dead_letters,
    }
    # Every 30 s: at info only the first time and when something changed that an operator acts on
    # (workers came or went, jobs wait orphaned, dead letters); the rest is in /metrics anyway.
    notable = (stats["ready_workers"], stats["orphaned"], stats["dead_letters"])
    changed = notable != hk.last_sweep.get(model) or stats["pruned_workers"] or stats["consumers_removed"]
    hk.last_sweep[model] = notable
    (log.info if changed else log.debug)("housekeeping_sweep", model=model, **stats)
    return stats


async def sample_history(hk: Housekeeper) -> None:
    """One sample of every served model's levels into its history (the console's chart,
    shared/browse.py): every SAMPLE_S, so the last ten minutes are there when a page opens."""
    for name in await hk.redis.zrange(hk.keys.models(), 0, -1):
        try:
            await sample(hk.redis, hk.keys, name.decode())
        except ResponseError as exc:  # Redis at its memory limit, a replica: the chart has a gap, no more
            log.debug("history_sample_refused", model=name.decode(), error=str(exc))


# A consumer this idle, holding nothing, whose worker's heartbeat key is gone, belongs to a dead
# worker (consumer names are worker ids). The heartbeat check is what protects a live worker.
STALE_CONSUMER_MS = 10 * 60 * 1000


async def _remove_dead_consumers(hk: Housekeeper, reading: QueueReading) -> int:
    removed = 0
    for level in reading.levels:
        for consumer in level.consumers:
            # DELCONSUMER discards the consumer's pending entries: only ever for one that holds
            # none (XDELCONSUMER answers how many it discarded: counted only when that was 0).
            if consumer.pending == 0 and consumer.idle_ms > STALE_CONSUMER_MS:
                if not await hk.redis.exists(hk.keys.worker(consumer.name)):
                    removed += await hk.redis.xgroup_delconsumer(level.stream, GROUP, consumer.name) == 0
    return removed


class _RedisSettings(RedisSettings):
    """arq's settings, with a repr that masks the password (arq's own shows it)."""

    def __repr__(self) -> str:
        shown = {**self.__dict__, "password": MASK if self.password else self.password}
        return f"RedisSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def arq_redis_settings(dsn: str) -> RedisSettings:
    """arq's connection settings for the same URL llmq's own clients use (a Sentinel URL too:
    :func:`_arq_sentinel_settings`). arq's ``from_dsn``
    drops the query (a private CA's ``ssl_ca_certs``, ``ssl_check_hostname``, ...) and keeps a
    percent-encoded password encoded; redis-py reads both, so llmq does too."""
    sentinel = sentinel_target(dsn)
    if sentinel is not None:
        return _arq_sentinel_settings(sentinel)
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


def _arq_sentinel_settings(target: SentinelTarget) -> RedisSettings:
    """arq's settings for a Sentinel URL. arq's Sentinel client (``create_pool``) passes on the
    Sentinels' addresses, the service, db, the data nodes' credentials and TLS on or off, and
    nothing else: a URL that needs more would connect without it, so it is refused at start-up."""
    options = target.node_options
    dropped = [f"sentinel_{name}" for name in target.sentinel_options]
    dropped += sorted(name for name in options if name.startswith("ssl_"))
    if dropped:
        raise ValueError(f"LLMQ_ARQ_REDIS_URL (LLMQ_REDIS_URL when unset): arq's Sentinel client cannot pass on "
                         f"{', '.join(dropped)}; give housekeeping a URL without them in LLMQ_ARQ_REDIS_URL")
    return _RedisSettings(host=list(target.sentinels), sentinel=True, sentinel_master=target.service,
                          database=options["db"], username=options.get("username"),
                          password=options.get("password"), ssl=options["ssl"])


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
    settings = load_settings()
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
