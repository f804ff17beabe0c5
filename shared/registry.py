"""Workers' presence in Redis: each worker's heartbeat hash and place in its model's ready set,
its control channel, and what peers and ``llmq-status`` read of them.

Written by workers/presence.py (one worker's own), read by it (its peers': who holds entries,
whose control channel has a subscriber) and by shared/status.py (every heartbeat). Job
operations are shared/queue/'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from shared.cluster import node_client, subscribers
from shared.keys import GROUP, Keys
from shared.queue import now_ms
from shared.redis import reply

__all__ = ["Registry"]


class Registry:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    # --- one worker's own presence -------------------------------------------------------------

    async def beat(self, model: str, worker: str, fields: Mapping[str, str | int | float | bytes], ttl_s: float, *,
                   advertise: bool) -> None:
        """One heartbeat in one round trip: ``worker``'s hash set to ``fields``, expiring after
        ``ttl_s`` (+1 s); with ``advertise`` the worker in the model's ready set and the model in
        the set of models, each scored by that expiry, else the worker out of the ready set; then
        the ready set's expired members dropped."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.worker(worker), mapping=dict(fields))
        pipe.expire(self.keys.worker(worker), int(ttl_s) + 1)
        expiry = now_ms() + ttl_s * 1000
        pipe.zadd(self.keys.heartbeats(), {worker: expiry})
        pipe.zremrangebyscore(self.keys.heartbeats(), 0, now_ms())
        if advertise:
            pipe.zadd(self.keys.workers(model), {worker: expiry})
            pipe.zadd(self.keys.models(), {model: expiry}, gt=True)  # how APIs discover models
        else:
            pipe.zrem(self.keys.workers(model), worker)
        pipe.zremrangebyscore(self.keys.workers(model), 0, now_ms())
        await pipe.execute()

    async def describe(self, model: str, info: bytes) -> None:
        """What ``model`` takes (JSON ``shared.media.ModelInfo``), for the APIs: written by each of
        its workers as it comes up, the last one's standing."""
        await reply(self.redis.hset(self.keys.model_info(), mapping={model: info}))

    async def deregister(self, model: str, worker: str) -> None:
        """Remove ``worker``'s hash and its place in the model's ready set."""
        await self.redis.delete(self.keys.worker(worker))
        await self.redis.zrem(self.keys.workers(model), worker)
        await self.redis.zrem(self.keys.heartbeats(), worker)

    @contextlib.asynccontextmanager
    async def control_subscription(self, model: str, worker: str) -> AsyncIterator[PubSub]:
        """A subscription to ``worker``'s control channel (cancel notices name a job id), closed on
        exit. On a Cluster it is made on the master of the model's slot, where peers count its
        subscribers (:meth:`subscribed`; PUBLISH reaches every node), looked up per call: after a
        failover it moves."""
        client = pubsub = None
        try:
            client = await node_client(self.redis, self.keys.queue(model))
            pubsub = client.pubsub()
            await pubsub.subscribe(self.keys.worker_control(worker))
            yield pubsub
        finally:
            if pubsub is not None:
                await pubsub.aclose()
            if client is not None and client is not self.redis:
                await client.aclose()

    # --- peers --------------------------------------------------------------------------------

    async def holders(self, model: str, consumer: str) -> set[str]:
        """The consumers other than ``consumer`` that hold entries (delivered, unanswered) at any
        level: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for queue in self.keys.queues(model):
            pipe.xinfo_consumers(queue, GROUP)
        return {c["name"].decode() for level in await pipe.execute() for c in level
                if c["pending"] and c["name"].decode() != consumer}

    async def subscribed(self, model: str, workers: list[str]) -> list[int]:
        """How many subscribers each worker's control channel has, in order (0: its process is
        gone, or its connection is). On a Cluster counted on the node the workers subscribe on
        (shared/cluster.py)."""
        channels = [self.keys.worker_control(w) for w in workers]
        return await subscribers(self.redis, channels, self.keys.queue(model))

    async def heartbeats(self) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """(worker id, heartbeat fields) of every live worker: those the heartbeats set names, read
        in one round trip, with no SCAN of the keyspace (whose cost grows with the job records)."""
        ids = [i.decode() for i in await self.redis.zrangebyscore(self.keys.heartbeats(), now_ms(), "+inf")]
        names = [self.keys.worker(i) for i in ids]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        for name, fields in zip(names, await pipe.execute() if names else [], strict=True):
            if fields:  # else it expired after the set was read
                yield self.keys.worker_id(name), {k.decode(): v.decode() for k, v in fields.items()}
