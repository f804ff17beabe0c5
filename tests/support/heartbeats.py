"""A worker's heartbeat with no engine behind it, written by workers/presence.py as a worker's is:
for the tests of what the API and llmq-status show of a worker whose engine no test can build
here (several GPUs, several hosts)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from redis.asyncio import Redis

from shared.config import load_settings
from shared.keys import Keys
from shared.metrics import Recorder
from shared.registry import Registry
from workers.presence import Presence

__all__ = ["beating"]


@contextlib.asynccontextmanager
async def beating(redis: Redis, prefix: str, worker_id: str, model: str, *, device: str = "",
                  devices: Sequence[str] = (), **settings: object) -> AsyncIterator[Presence]:
    """Worker ``worker_id`` of ``model``, its heartbeat written once, ``warming`` (so its model
    joins no list of models: a module's other tests see the deployment they expect), with
    ``settings`` (``tensor_parallel_size=2``, ...) and the claimed ``device`` and ``devices``; gone
    on leaving."""
    presence = Presence(load_settings({}, served_model_name=model, **settings), Registry(redis, Keys(prefix)),
                        worker_id, Recorder(model), device=device, devices=devices)
    await presence.beat("warming", running=0)
    try:
        yield presence
    finally:
        await presence.unregister()
