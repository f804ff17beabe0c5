"""Reading a job's record from Redis while a test's stack runs it (``tests.support.scripted_stack``
serves the model "tiny")."""

from __future__ import annotations

from redis.asyncio import Redis

from shared.keys import Keys
from shared.queue import JobStore
from shared.schemas import JobRecord
from tests.support.waiting import eventually

__all__ = ["MODEL", "record", "wait_status", "running_job"]

MODEL = "tiny"  # scripted_stack's model


async def record(redis: Redis, prefix: str, job_id: str) -> JobRecord | None:
    return await JobStore(redis, Keys(prefix)).get_job(MODEL, job_id)


async def wait_status(redis: Redis, prefix: str, job_id: str, statuses: set[str], timeout: float = 20) -> JobRecord:
    """The job's record once its status is one of ``statuses``."""
    async def reached() -> JobRecord | None:
        rec = await record(redis, prefix, job_id)
        return rec if rec is not None and rec.status in statuses else None
    return await eventually(reached, timeout_s=timeout, interval_s=0.02, what=f"job {job_id} in {statuses}")


async def running_job(redis: Redis, keys: Keys, model: str, timeout_s: float = 20) -> str:
    """The id of the (single) job the worker is running."""
    async def running() -> str | None:
        async for key in redis.scan_iter(match=keys.job(model, "*")):
            if await redis.hget(key, "status") == b"running":
                return key.decode().rsplit(":", 1)[1]
        return None
    return await eventually(running, timeout_s=timeout_s, interval_s=0.02, what="a running job")
