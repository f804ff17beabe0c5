"""One pub/sub connection per API process, multiplexed across every in-flight request.

A request subscribes to its job's live channel *before* the job is enqueued and waits for Redis
to confirm the subscription, so no live event can be published before it is listening. Messages
fan out to per-request asyncio queues. After a reconnect every subscriber gets ``RESYNC`` and
backfills from the job's event log: pub/sub is treated as lossy, the log is the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from redis.asyncio import Redis

from shared.errors import QueueUnavailable
from shared.redis import REDIS_DOWN

__all__ = ["EventListener", "RESYNC"]

log = structlog.get_logger()

# Put in a subscriber's queue when live messages may have been missed.
RESYNC = b""


class EventListener:
    def __init__(self, redis: Redis, home_channel: str) -> None:
        self._redis = redis
        # Always subscribed, so the connection stays in pub/sub mode with no requests in flight.
        self._home = home_channel.encode()
        self._queues: dict[bytes, set[asyncio.Queue[bytes]]] = {}
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._pubsub = None
        self._connected = asyncio.Event()

    async def run(self) -> None:
        """Read messages until cancelled, reconnecting with backoff."""
        delay = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._home, *self._queues)
                self._pubsub = pubsub
                self._connected.set()
                if delay > 0.1:  # we were disconnected: live messages may be lost
                    log.info("listener_reconnected", channels=len(self._queues))
                    self._broadcast_resync()
                delay = 0.1
                while True:
                    # A bounded blocking read: an idle connection is not an error (a plain
                    # listen() would hit socket_timeout), and timeout=0 would spin the CPU.
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._dispatch(message)
            except REDIS_DOWN as exc:
                self._connected.clear()
                self._pubsub = None
                log.warning("listener_disconnected", retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                await pubsub.aclose()

    def _dispatch(self, message: dict) -> None:
        kind = message["type"]
        channel = message["channel"]
        if kind == "message":
            for queue in self._queues.get(channel, ()):
                queue.put_nowait(message["data"])
        elif kind == "subscribe":
            future = self._confirmations.pop(channel, None)
            if future is not None and not future.done():
                future.set_result(None)
            else:
                # A re-subscription: redis-py reconnects and re-subscribes by itself (no error
                # reaches run()), and messages published meanwhile are gone. From this
                # confirmation on, every event arrives live; every earlier one is in the log.
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(RESYNC)

    def _broadcast_resync(self) -> None:
        for queues in self._queues.values():
            for queue in queues:
                queue.put_nowait(RESYNC)

    @asynccontextmanager
    async def subscribe(self, channel: str, *, timeout_s: float = 2.0) -> AsyncIterator[asyncio.Queue[bytes]]:
        """Yield a queue of this channel's messages; Redis has confirmed the subscription."""
        key = channel.encode()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        first = key not in self._queues
        self._queues.setdefault(key, set()).add(queue)
        try:
            if first:
                try:
                    await asyncio.wait_for(self._confirmed_subscribe(key), timeout_s)
                except TimeoutError:
                    raise QueueUnavailable("the queue's pub/sub connection is not available") from None
            yield queue
        finally:
            subscribers = self._queues.get(key)
            if subscribers is not None:
                subscribers.discard(queue)
                if not subscribers:
                    del self._queues[key]
                    await self._unsubscribe(key)

    async def _confirmed_subscribe(self, key: bytes) -> None:
        await self._connected.wait()
        future = self._confirmations.get(key)
        if future is None:
            future = self._confirmations[key] = asyncio.get_running_loop().create_future()
        assert self._pubsub is not None
        await self._pubsub.subscribe(key)
        await future

    async def _unsubscribe(self, key: bytes) -> None:
        self._confirmations.pop(key, None)
        if self._pubsub is not None:
            try:
                await self._pubsub.unsubscribe(key)
            except REDIS_DOWN:
                pass  # the connection is gone, and its subscriptions with it
