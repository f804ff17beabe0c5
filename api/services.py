"""What request handlers use, owned by the app's lifespan (one Redis client, one listener, one HTTP
client for image URLs)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar import Litestar
from litestar.di import NamedDependency
from redis.asyncio import Redis

from api.auth import configured_keys, owner_of, parse_keys
from api.listener import EventListener, Listener
from api.media import Media
from api.models import ModelRegistry
from api.shards import ClusterListener
from api.tokenizer import Tokenizer
from shared.cluster import is_cluster
from shared.config import Settings
from shared.durability import check_server
from shared.keys import SHARDS, Keys
from shared.queue import JobStore
from shared.redis import REDIS_DOWN, connect, wait_for_redis
from shared.redis_memory import EvictingRedis, MemoryGuard, check_policy
from shared.tenants import ConfigCache

__all__ = ["Services", "Svc", "lifespan"]


@dataclass(slots=True)
class Services:
    settings: Settings
    keys: Keys
    queue: JobStore
    listener: Listener
    models: ModelRegistry
    tokenizer: Tokenizer
    """The served model's tokenizer (TGI's /tokenize and truncate, special-token ids), loaded on first use."""
    tenants: ConfigCache
    """Tenants' weights and limits, as operators set them in Redis (shared/tenants.py)."""
    media: Media | None = None
    """Images at admission: their store, the fetcher of image URLs and what each model takes
    (api/media.py). None only in services a test builds without: a request with images then fails."""
    instance: str = "0"
    """This API process's id: its home channel and relay channels (Keys.relay) carry it."""
    keys_on: bool = False
    """API or operator keys are configured (``LLMQ_API_KEYS``, ``LLMQ_OPERATOR_KEYS``): jobs record
    their owner's key hash."""
    operators: frozenset[str] = frozenset()
    """The operator keys' hashes: their holders see and act on every job (api/auth.py)."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    kept: set[str] = field(default_factory=set)
    """Models whose relay channels this process has subscribed (:meth:`keep_relays`)."""
    sharded: bool = False
    """Redis is a Cluster: a relay channel per token shard (Keys.relay)."""
    errors: dict[tuple[int, str], int] = field(default_factory=dict)
    """Error answers of this process by (status, code): ``llmq_api_errors_total`` (api/errors.py counts)."""

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` to completion even if the request that started it is cancelled (a
        cancel-on-disconnect runs inside a cancelled scope); the set keeps the task alive."""
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def keep_relays(self, model: str) -> None:
        """Subscribe ``model``'s relay channels (one per token shard on a Cluster), once per process:
        the first job of the model subscribes them all, so later ones are live from their first event."""
        if model not in self.kept:
            self.kept.add(model)
            for shard in range(SHARDS if self.sharded else 1):
                await self.listener.keep(self.keys.relay_in(model, shard, self.instance))

    def relay_channel(self, model: str, job_id: str) -> str:
        """Where workers publish the events of ``job_id`` to this process (Keys.relay)."""
        return self.keys.relay(model, self.instance, job_id, sharded=self.sharded)

    @property
    def model(self) -> str:
        """The default model: what a request that names none goes to."""
        return self.settings.model_name


log = structlog.get_logger()

# How handlers ask for the services: ``svc: Svc`` (injected by name).
Svc = NamedDependency[Services]


@asynccontextmanager
async def lifespan(app: Litestar) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    keys = Keys(settings.prefix)
    redis = connect(settings.redis_dsn, block_ms=settings.block_ms)
    instance = os.urandom(4).hex()
    home = keys.api_home(instance)
    listener = ClusterListener(redis, home) if is_cluster(redis) else EventListener(redis, home)
    services = Services(
        settings=settings,
        keys=keys,
        queue=JobStore(redis, keys, result_ttl_s=settings.result_ttl_s, idempotency_ttl_s=settings.idempotency_ttl_s,
                       usage_days=settings.usage_days,
                       durability=settings.acknowledgement, recent_jobs=settings.recent_jobs,
                       memory=MemoryGuard(redis, settings.redis_memory_watermark)),
        listener=listener,
        models=ModelRegistry(redis, keys, settings.model_name, settings.extra_models,
                             max_model_len=settings.max_model_len),
        tokenizer=Tokenizer(settings.model_path),
        tenants=ConfigCache(redis, keys),
        media=Media.of(redis, keys, settings),
        keys_on=bool(configured_keys(settings)),
        operators=frozenset(owner_of(k) for k in parse_keys(settings.operator_keys)),
        instance=instance,
        sharded=is_cluster(redis),
    )
    # The listener reconnects by itself, so the API starts (and answers 503) before Redis is up.
    # Then the eviction policy is checked once Redis answers, and the process stops if it fails.
    policy = await _check_redis(redis, settings)
    task = asyncio.create_task(listener.run(), name="event-listener")
    app.state.services = services
    try:
        yield
    finally:
        if policy is not None:
            policy.cancel()
        if services.background:  # cancels of disconnected requests: let them reach Redis
            await asyncio.wait(list(services.background), timeout=5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if services.media is not None:
            await services.media.aclose()
        await redis.aclose()


async def _check_redis(redis: Redis, settings: Settings) -> asyncio.Task[None] | None:
    """Refuse to start on a Redis that may evict jobs (shared/redis_memory.py) or cannot give the
    durability asked for (shared/durability.py): at once when Redis answers now; else a task that
    checks once it does, and stops the process (SIGTERM) if it must."""
    async def check() -> None:
        await check_policy(redis, allow_eviction=settings.redis_allow_eviction, process="web")
        await check_server(redis, settings.acknowledgement)

    try:
        async with asyncio.timeout(2):
            await check()
        return None
    except REDIS_DOWN:  # the builtin TimeoutError is an OSError
        pass

    async def later() -> None:
        while True:
            await wait_for_redis(redis, what="web")
            try:
                await check()
                return
            except (EvictingRedis, ValueError) as exc:
                log.error("redis_unfit", error=str(exc))
                os.kill(os.getpid(), signal.SIGTERM)
                return
            except REDIS_DOWN:
                await asyncio.sleep(1)

    return asyncio.create_task(later(), name="redis-policy")
