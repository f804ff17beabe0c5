"""The API's pub/sub listener on a Redis Cluster (``redis+cluster://``): api/listener.py, routed.

It decides once, when Redis first answers, how live events travel (shared/cluster.py):

- plain pub/sub (any master older than Redis 7): one :class:`EventListener` on one master
  receives every PUBLISH, as the cluster bus broadcasts it;
- sharded pub/sub (every master Redis >= 7): a message stays on the master owning its
  channel's slot, so there is one listener per master in use, started the first time a request
  follows a channel there, each subscribing with SSUBSCRIBE.

Either way requests use the same three members as on a single Redis: ``subscribe``,
``confirmed`` and ``channels``. Whatever the live path misses (a master failing over or a slot
moving mid-stream), the relay still reads from the job's event log once it has been quiet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode

from api.listener import EventListener, Inbox, Listener
from shared.cluster import sharded_pubsub
from shared.errors import QueueUnavailable
from shared.redis import REDIS_DOWN

__all__ = ["ClusterListener"]

log = structlog.get_logger()


class ClusterListener(Listener):
    def __init__(self, redis: RedisCluster, home_channel: str, *, idle_s: float = 5.0) -> None:
        self._redis = redis
        self._home = home_channel
        self._idle_s = idle_s
        self._decided = asyncio.Event()
        self._plain: EventListener | None = None
        self._shards: dict[str, EventListener] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def sharded(self) -> bool | None:
        """None until the mode is decided (Redis has not answered yet)."""
        return None if not self._decided.is_set() else self._plain is None

    @property
    def channels(self) -> int:
        listeners = [self._plain] if self._plain is not None else list(self._shards.values())
        return sum(listener.channels for listener in listeners)

    async def run(self) -> None:
        """Decide the mode (retrying until Redis answers), then run the listener(s) until cancelled."""
        delay = 0.1
        while True:
            try:
                sharded = await sharded_pubsub(self._redis)
                break
            except REDIS_DOWN as exc:
                log.warning("listener_disconnected", retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.info("listener_mode", pubsub="sharded" if sharded else "plain")
        if not sharded:
            self._plain = EventListener(self._redis, self._home, idle_s=self._idle_s)
            self._decided.set()
            await self._plain.run()
            return
        self._decided.set()
        try:
            await asyncio.Event().wait()  # the per-master listeners run as tasks, started on demand
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _route(self, channel: str, timeout_s: float) -> EventListener:
        try:
            await asyncio.wait_for(self._decided.wait(), timeout_s)
        except TimeoutError:
            raise QueueUnavailable("the queue's pub/sub connection is not available") from None
        if self._plain is not None:
            return self._plain
        node = self._master(channel)
        listener = self._shards.get(node.name)
        if listener is None:
            listener = self._shards[node.name] = EventListener(self._redis, self._home, idle_s=self._idle_s,
                                                               node=node, sharded=True)
            task = asyncio.create_task(listener.run(), name=f"event-listener-{node.name}")
            self._tasks.add(task)
        return listener

    def _master(self, channel: str) -> ClusterNode:
        """The master serving ``channel``'s slot (an unserved slot raises SlotNotCoveredError)."""
        node = self._redis.get_node_from_key(channel)
        assert node is not None  # None answers only a request for a replica
        return node

    @asynccontextmanager
    async def subscribe(self, channel: str, *, timeout_s: float = 2.0, wait: bool = True
                        ) -> AsyncIterator[asyncio.Queue[bytes]]:
        """:meth:`EventListener.subscribe` on the listener that receives ``channel``."""
        listener = await self._route(channel, timeout_s)
        async with listener.subscribe(channel, timeout_s=timeout_s, wait=wait) as queue:
            yield queue

    @asynccontextmanager
    async def follow(self, channel: str, job_id: str, *, timeout_s: float = 2.0, wait: bool = True
                     ) -> AsyncIterator[Inbox]:
        """:meth:`EventListener.follow` on the listener that receives ``channel``."""
        listener = await self._route(channel, timeout_s)
        async with listener.follow(channel, job_id, timeout_s=timeout_s, wait=wait) as queue:
            yield queue

    async def keep(self, channel: str) -> None:
        await (await self._route(channel, 2.0)).keep(channel)

    def in_effect(self, channel: str) -> bool:
        if not self._decided.is_set():
            return False
        if self._plain is not None:
            return self._plain.in_effect(channel)
        listener = self._shards.get(self._master(channel).name)
        return listener is not None and listener.in_effect(channel)

    async def confirmed(self, channel: str, *, timeout_s: float = 2.0) -> None:
        await (await self._route(channel, timeout_s)).confirmed(channel, timeout_s=timeout_s)
