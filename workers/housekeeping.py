"""``python -m workers.housekeeping``: the arq process for cron and retryable background work.

The hot path never goes through arq (it polls a sorted set); this process runs sweeps: for now
it prunes expired worker registrations and logs each model's queue depth, lag and pending count.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from arq import cron
from arq.connections import RedisSettings
from arq.worker import run_worker
from redis.exceptions import ResponseError

from shared.config import Settings, load_settings
from shared.keys import GROUP, Keys
from shared.logging import configure_logging
from shared.queue import now_ms
from shared.redis import connect, wait_for_redis

log = structlog.get_logger()


async def sweep(ctx: dict[str, Any]) -> dict[str, int]:
    settings: Settings = ctx["settings"]
    keys: Keys = ctx["keys"]
    redis = ctx["redis"]
    model = settings.model_name
    pruned = await redis.zremrangebyscore(keys.workers(model), 0, now_ms())
    stats = {"ready_workers": await redis.zcard(keys.workers(model)), "pruned_workers": pruned}
    try:
        for group in await redis.xinfo_groups(keys.queue(model)):
            if group["name"].decode() == GROUP:
                stats.update(pending=group["pending"], lag=group.get("lag") or 0)
    except ResponseError:  # no queue yet
        pass
    stats["queued"] = await redis.xlen(keys.queue(model))
    log.info("housekeeping_sweep", model=model, **stats)
    return stats


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    ctx["keys"] = Keys(settings.prefix)
    # arq's own client is for its queue; this one reads llmq's keys (bytes, our timeouts).
    ctx["redis"] = connect(settings.redis_dsn)


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["redis"].aclose()


class WorkerSettings:
    functions: list = []
    cron_jobs = [cron(sweep, second={0, 30}, run_at_startup=True)]
    on_startup = startup
    on_shutdown = shutdown


def main() -> None:
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_json)

    async def ready() -> None:
        redis = connect(settings.redis_dsn)
        await wait_for_redis(redis, what="housekeeping")
        await redis.aclose()

    asyncio.run(ready())
    run_worker(
        WorkerSettings,  # type: ignore[arg-type]
        redis_settings=RedisSettings.from_dsn(settings.redis_dsn),
        queue_name=Keys(settings.prefix).arq_queue(),
        ctx={"settings": settings},
    )


if __name__ == "__main__":
    main()
