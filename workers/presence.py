"""A worker's presence in Redis: its heartbeat key, its place in the ready set, its control
channel. A mixin of :class:`workers.runner.Worker`, kept apart so each module stays small.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING

import structlog

from shared.cluster import node_client
from shared.errors import JobCancelled
from shared.metrics import Recorder, encode_samples
from shared.queue import now_ms
from shared.redis import REDIS_DOWN

if TYPE_CHECKING:
    from shared.config import Settings
    from shared.errors import ServiceError
    from shared.queue import Queue

__all__ = ["Presence"]

log = structlog.get_logger()


class Presence:
    """Needs from its host: settings, queue, model, worker_id, slots, started_at, ready,
    ``_running``, ``_stopping`` and :meth:`cancel_job`."""

    settings: Settings
    queue: Queue
    model: str
    worker_id: str
    slots: int
    started_at: float
    ready: bool
    metrics: Recorder
    device = ""
    """The GPU(s) or CPU share this process claimed (workers/claim.py), set by its entrypoint."""
    _running: dict
    _stopping: asyncio.Event

    def cancel_job(self, job_id: str, reason: ServiceError) -> bool:
        raise NotImplementedError

    async def _peer_ready(self) -> bool:
        try:
            ready = await self.queue.redis.zrangebyscore(self.queue.keys.workers(self.model), now_ms(), "+inf")
        except REDIS_DOWN:
            return False
        return any(w.decode() != self.worker_id for w in ready)

    def _heartbeat_fields(self) -> dict[str, str | int | float | bytes]:
        return {
            "model": self.model,
            "slots": self.slots,
            "running": len(self._running),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": self.device,
            "started": self.started_at,
            "status": "draining" if self._stopping.is_set() else ("ready" if self.ready else "warming"),
            "last_heartbeat": now_ms(),
            # Its Prometheus counters and histograms, served by the API's /metrics.
            "metrics": encode_samples(self.metrics.samples()),
        }

    async def _beat(self) -> None:
        keys = self.queue.keys
        ttl_s = self.settings.heartbeat_s * 3
        pipe = self.queue.redis.pipeline(transaction=False)
        pipe.hset(keys.worker(self.worker_id), mapping=self._heartbeat_fields())
        pipe.expire(keys.worker(self.worker_id), int(ttl_s) + 1)
        if self.ready and not self._stopping.is_set():
            # The API answers health checks from this set: only warm workers are in it.
            expiry = now_ms() + ttl_s * 1000
            pipe.zadd(keys.workers(self.model), {self.worker_id: expiry})
            pipe.zadd(keys.models(), {self.model: expiry}, gt=True)  # how APIs discover models
        else:
            pipe.zrem(keys.workers(self.model), self.worker_id)
        pipe.zremrangebyscore(keys.workers(self.model), 0, now_ms())
        await pipe.execute()

    async def _unregister(self) -> None:
        keys = self.queue.keys
        try:
            await self.queue.redis.delete(keys.worker(self.worker_id))
            await self.queue.redis.zrem(keys.workers(self.model), self.worker_id)
        except REDIS_DOWN:
            pass

    async def _control(self) -> None:
        """Abort jobs on request (DELETE /v1/jobs/{id}); the notice names the job id."""
        channel = self.queue.keys.worker_control(self.worker_id)
        while True:
            client = pubsub = None
            try:
                # On a Cluster: one node's client (PUBLISH reaches every node), a fresh pick per attempt.
                client = await node_client(self.queue.redis)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    job_id = message["data"].decode()
                    if self.cancel_job(job_id, JobCancelled("job was cancelled")):
                        log.info("job_cancel_requested", job_id=job_id)
            except REDIS_DOWN as exc:
                log.warning("control_channel_lost", error=str(exc))
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                if client is not None and client is not self.queue.redis:
                    await client.aclose()
