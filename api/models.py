"""Which models this deployment serves right now, read from the workers' heartbeats.

Workers advertise their model in ``llmq:models`` (model -> heartbeat expiry) and themselves in
the model's ``workers`` set. A request names a model (or gets the default); the model must be
live or the configured default, else the dialect's 404. A known model with no warm worker is
refused with 503 + Retry-After instead of queued: without a deadline a queued job could wait
forever for a worker that never comes.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from shared.errors import ModelNotFound, ModelUnavailable
from shared.keys import Keys
from shared.queue import now_ms

__all__ = ["ModelRegistry"]


class ModelRegistry:
    def __init__(self, redis: Redis, keys: Keys, default: str, *, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.default = default
        self.cache_s = cache_s
        self._live: dict[str, int] = {}
        self._read_at = float("-inf")

    async def live(self, *, fresh: bool = False) -> dict[str, int]:
        """Live model name -> number of warm workers; cached for ``cache_s`` (one read per second
        per API process, whatever the request rate)."""
        if not fresh and time.monotonic() - self._read_at < self.cache_s:
            return self._live
        now = now_ms()
        names = [n.decode() if isinstance(n, bytes) else n
                 for n in await self.redis.zrangebyscore(self.keys.models(), now, "+inf")]
        if self.default not in names:
            names.append(self.default)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.zcount(self.keys.workers(name), now, "+inf")
        counts = await pipe.execute()
        self._live = {name: count for name, count in zip(names, counts, strict=True) if count}
        self._read_at = time.monotonic()
        return self._live

    async def ever_served(self) -> list[str]:
        """Every model a worker has advertised (live or not) and the default: where a job id may
        be found, since results outlive the workers that made them."""
        names = [n.decode() if isinstance(n, bytes) else n for n in await self.redis.zrange(self.keys.models(), 0, -1)]
        return [self.default, *(n for n in names if n != self.default)]

    async def resolve(self, name: str | None) -> str:
        """The model a request goes to; raises ModelNotFound or ModelUnavailable."""
        model = name or self.default
        live = await self.live()
        if model not in live:
            live = await self.live(fresh=True)  # a worker that just came up is never refused
        if model not in live:
            if model != self.default:
                raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
            raise ModelUnavailable(f"No worker is serving the model `{model}` right now; retry shortly.")
        return model
