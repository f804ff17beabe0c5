"""The API on a real local port plus an in-process worker with a scripted engine, on real Redis.

Streaming tests need a real server (in-process test clients buffer whole responses); the
scripted engine makes every token known in advance, so tests can pin wire bytes exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import uvicorn
from redis.asyncio import Redis

from api.app import create_app
from shared.config import Settings, load_settings
from shared.keys import Keys
from shared.media import TEXT_ONLY, ModelInfo
from shared.queue import Consumer
from shared.redis import connect
from tests.conftest import free_port
from tests.support.scripted_engine import ScriptedEngine
from tests.support.waiting import eventually
from workers.runner import Worker

if TYPE_CHECKING:
    from shared.tracing import Tracing

__all__ = ["ScriptedStack", "scripted_stack", "serve_api", "scripted_settings"]


@dataclass
class ScriptedStack:
    client: httpx.AsyncClient
    url: str
    redis: Redis
    settings: Settings
    worker: Worker


def scripted_settings(redis_url: str, prefix: str, **overrides: object) -> Settings:
    """Settings for a test API: model "tiny", a free port, short blocking reads and keep-alives."""
    base: dict[str, object] = dict(redis_url=redis_url, prefix=prefix, served_model_name="tiny", port=free_port(),
                                   block_ms=200, sse_keepalive_s=0.5)
    return load_settings({}, **{**base, **overrides})


@asynccontextmanager
async def serve_api(settings: Settings, routes: Sequence[object] = (), tracing: Tracing | None = None,
                    ) -> AsyncIterator[str]:
    """uvicorn serving the real app (plus any test-only ``routes``); yields its base URL."""
    app = create_app(settings, tracing)
    for route in routes:
        app.register(route)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started, timeout_s=60, what="the API to serve")
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def scripted_stack(
    redis_url: str,
    prefix: str,
    engine: ScriptedEngine | None = None,
    *,
    routes: Sequence[object] = (),
    tracing: Tracing | None = None,
    info: ModelInfo = TEXT_ONLY,
    **overrides: object,
) -> AsyncIterator[ScriptedStack]:
    """``tracing``: one tracer for the API and the worker alike (tests/integration/test_tracing.py);
    ``info``: what the worker says its model takes (images: tests/integration/test_images.py)."""
    settings = scripted_settings(redis_url, prefix, **overrides)
    async with serve_api(settings, routes, tracing) as url:
        redis = connect(redis_url)
        engine = engine if engine is not None else ScriptedEngine(delay_s=0.001)
        durability = settings.acknowledgement
        worker = Worker(settings, Consumer(redis, Keys(prefix), durability=durability), engine, worker_id=f"w-{prefix}",
                        tracing=tracing, info=info)
        worker_task = asyncio.create_task(worker.run())
        try:
            # Registered in the model's worker set, not just warm: only then does the API route to it.
            async def registered() -> bool:
                return await redis.zscore(Keys(prefix).workers(settings.model_name), worker.worker_id) is not None
            await eventually(registered, timeout_s=120, what="the worker to register")
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                yield ScriptedStack(client=client, url=url, redis=redis, settings=settings, worker=worker)
        finally:
            worker.stop()
            await asyncio.wait_for(worker_task, 10)
            await redis.aclose()
