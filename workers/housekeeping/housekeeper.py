"""The one typed value every housekeeping task works with: the :class:`Housekeeper`.

It lives apart from the process module (``__main__``) so that the tasks (webhooks, batches,
sweeps) can import its type while the process module imports them to schedule them.
"""

from __future__ import annotations

import dataclasses

import httpx
from arq import ArqRedis
from redis.asyncio import Redis

from shared.config import Settings
from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import connect
from shared.redis_memory import MemoryGuard

__all__ = ["Housekeeper"]


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
