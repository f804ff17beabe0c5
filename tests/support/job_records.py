"""Reading a job's record from Redis while a test's stack runs it (``tests.support.scripted_stack``
serves the model "tiny")."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from shared.keys import Keys
from shared.queue import Queue
from shared.schemas import JobRecord

__all__ = ["MODEL", "record", "wait_status"]

MODEL = "tiny"  # scripted_stack's model


async def record(redis: Redis, prefix: str, job_id: str) -> JobRecord | None:
    return await Queue(redis, Keys(prefix)).get_job(MODEL, job_id)


async def wait_status(redis: Redis, prefix: str, job_id: str, statuses: set[str], timeout: float = 20) -> JobRecord:
    """The job's record once its status is one of ``statuses``."""
    async with asyncio.timeout(timeout):
        while True:
            rec = await record(redis, prefix, job_id)
            if rec is not None and rec.status in statuses:
                return rec
            await asyncio.sleep(0.02)
