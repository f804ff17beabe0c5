"""A worker's presence in Redis: its heartbeat key, its place in the ready set, its control
channel. A mixin of :class:`workers.runner.Worker`, kept apart so each module stays small.

The control channel is also the worker's sign of life. Its subscription lives exactly as long as
its process (the kernel closes a dead process's sockets, and Redis drops their subscriptions at
once), so a peer that finds a worker holding jobs with nobody subscribed to its channel for
``LLMQ_TAKEOVER_S`` takes those jobs over without waiting for their leases (workers/runner.py,
the watcher). Hence: no job is read before the subscription is confirmed, a dropped connection is
re-subscribed at once, and :attr:`Presence._watch_from` keeps the watcher from judging peers
until they all had time to re-subscribe after an outage that dropped everyone's connection.
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

__all__ = ["Presence", "RECONNECT_MAX_S"]

log = structlog.get_logger()

# The longest pause between a lost control connection's attempts to re-subscribe (the first
# comes at once). After an outage of Redis every worker is back within about this long, which
# is what the watcher waits (twice over) before it counts anyone's absence.
RECONNECT_MAX_S = 0.5


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
    _control_up: asyncio.Event
    """Set while the control subscription is confirmed: the reader reads only then."""
    _watch_from: float
    """Loop time before which the watcher counts no peer's absence (our own subscription came up
    only recently: after an outage, peers may still be re-subscribing)."""

    def cancel_job(self, job_id: str, reason: ServiceError) -> bool:
        raise NotImplementedError

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

    def _control_confirmed(self) -> None:
        self._control_up.set()
        self._watch_from = asyncio.get_running_loop().time() + 2 * RECONNECT_MAX_S

    async def _control(self) -> None:
        """Abort jobs on request (DELETE /v1/jobs/{id}); the notice names the job id. The
        subscription itself says this process is alive (see the module docstring)."""
        channel = self.queue.keys.worker_control(self.worker_id)
        delay = 0.0
        while True:
            client = pubsub = None
            try:
                # On a Cluster: the master of the model's slot, where peers count its subscribers
                # (PUBLISH reaches every node). Looked up per attempt: after a failover it moves.
                client = await node_client(self.queue.redis, self.queue.keys.queue(self.model))
                pubsub = client.pubsub()
                await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # Confirmed: the first time, or after redis-py reconnected and re-subscribed
                        # by itself (a dropped connection, a restarted Redis).
                        self._control_confirmed()
                        delay = 0.0
                    elif message["type"] == "message":
                        job_id = message["data"].decode()
                        if self.cancel_job(job_id, JobCancelled("job was cancelled")):
                            log.info("job_cancel_requested", job_id=job_id)
            except REDIS_DOWN as exc:
                self._control_up.clear()
                log.warning("control_channel_lost", error=str(exc), retry_in_s=delay)
                # At once the first time: peers take a worker without a subscription for dead
                # after LLMQ_TAKEOVER_S. Then backing off, while Redis itself is away.
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), RECONNECT_MAX_S)
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                if client is not None and client is not self.queue.redis:
                    await client.aclose()
