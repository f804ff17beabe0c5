"""One pub/sub connection per API process, multiplexed across every in-flight request.

A request follows its job through this process's relay channel for the job's model and token
shard (``Keys.relay``: one per shard, all of a model's kept subscribed from its first job):
workers publish the events of every job this process follows in one message per flush, and
:meth:`EventListener.follow` splits them out to per-request asyncio queues by job id.
The channel is subscribed on first use and kept: the job's record names it, and the request reads
the job's log only once Redis has confirmed the subscription, so no event falls between the two.
Plain channels (:meth:`EventListener.subscribe`) carry one message per event, as a job's own live
channel does when no follower is recorded for it. After a reconnect every subscriber gets ``RESYNC`` and
backfills from the job's event log: pub/sub is treated as lossy, the log is the truth.

On a Redis Cluster the connection goes to one master (plain PUBLISH reaches every node), or, with
sharded pub/sub (Redis >= 7), to the master owning the followed channels' slots: api/shards.py
runs one listener per such master, each with ``sharded=True`` (SSUBSCRIBE, ``smessage``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.cluster import pubsub_connection
from shared.errors import QueueUnavailable
from shared.redis import REDIS_DOWN

__all__ = ["Listener", "EventListener", "Inbox", "RESYNC"]

log = structlog.get_logger()

# Put in a subscriber's queue when live messages may have been missed.
RESYNC = b""


class Inbox(asyncio.Queue[bytes]):
    """A follower's queue of one job's relay messages, which a ``sink`` may take instead.

    While ``sink`` is set (its follower waits on an empty queue), :meth:`put_nowait` hands each
    message to it first, in the listener's own step: a sink that writes the message's frames
    itself costs no wake-up of the follower's task. What it declines (a gap, the terminal event,
    a stream under back-pressure) is queued as before, and so is everything after, in order."""

    sink: Callable[[bytes], bool] | None = None

    def put_nowait(self, item: bytes) -> None:
        sink = self.sink
        if sink is not None and self.empty() and sink(item):
            return
        super().put_nowait(item)


class Listener:
    """What request handlers use: this module's EventListener, or api/shards.py's ClusterListener."""

    @property
    def channels(self) -> int:
        """Jobs being followed through this listener right now."""
        raise NotImplementedError

    async def run(self) -> None:
        raise NotImplementedError

    def subscribe(self, channel: str, *, timeout_s: float = 2.0, wait: bool = True
                  ) -> AbstractAsyncContextManager[asyncio.Queue[bytes]]:
        raise NotImplementedError

    def follow(self, channel: str, job_id: str, *, timeout_s: float = 2.0, wait: bool = True
               ) -> AbstractAsyncContextManager[Inbox]:
        raise NotImplementedError

    async def confirmed(self, channel: str, *, timeout_s: float = 2.0) -> None:
        raise NotImplementedError

    async def keep(self, channel: str) -> None:
        """Subscribe relay ``channel`` for the process's life, following no job yet."""
        raise NotImplementedError

    def in_effect(self, channel: str) -> bool:
        raise NotImplementedError


class EventListener(Listener):
    def __init__(self, redis: Redis | RedisCluster, home_channel: str, *, idle_s: float = 5.0,
                 node: ClusterNode | None = None, sharded: bool = False) -> None:
        # Its own connection, opened like every other one of this client (URL, auth, TLS), with no
        # per-read timeout: liveness is checked by PING once a quiet window passes (see _read).
        self._new_connection = lambda: pubsub_connection(redis, node)
        self._sharded = sharded
        self._sub, self._unsub = ("SSUBSCRIBE", "SUNSUBSCRIBE") if sharded else ("SUBSCRIBE", "UNSUBSCRIBE")
        self._resubscribing: set[asyncio.Task[None]] = set()
        self._idle_s = idle_s
        # Always subscribed, so the connection stays in pub/sub mode with no requests in flight.
        self._home = home_channel.encode()
        self._queues: dict[bytes, set[asyncio.Queue[bytes]]] = {}
        # Relay channels: per channel, job id -> its followers' queues. A channel stays subscribed
        # for the process's life once used (one per token shard of each model this process relays):
        # a request then needs no SUBSCRIBE round trip, and a job's record never names a channel
        # nobody reads.
        self._relays: dict[bytes, dict[bytes, set[Inbox]]] = {}
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._conn: AbstractConnection | None = None
        self._reads = 0

    @property
    def channels(self) -> int:
        """Jobs being followed through this listener right now."""
        return len(self._queues) + sum(len(jobs) for jobs in self._relays.values())

    async def run(self) -> None:
        """Read messages until cancelled, reconnecting with backoff."""
        delay = 0.1
        while True:
            conn: AbstractConnection | None = None
            try:
                async with asyncio.timeout(self._idle_s):  # reads have no timeout of their own here
                    conn = await self._new_connection()
                    await conn.connect()
                    # Set before the SUBSCRIBE below: a channel added while it is written then sends
                    # its own (see _send), so none falls between the two.
                    self._conn = conn
                    # Every channel again after a reconnect: each confirmation then tells that
                    # channel's subscribers to read the log (_dispatch): messages published meanwhile are gone.
                    if not self._sharded:
                        await conn.send_command("SUBSCRIBE", self._home, *self._queues, *self._relays,
                                                check_health=False)
                    else:  # the home channel stays plain; one SSUBSCRIBE per channel (one slot each)
                        await conn.send_command("SUBSCRIBE", self._home, check_health=False)
                        for channel in [*self._queues, *self._relays]:
                            await conn.send_command("SSUBSCRIBE", channel, check_health=False)
                if delay > 0.1:
                    log.info("listener_reconnected", channels=len(self._queues))
                delay = 0.1
                await self._read(conn)
            except REDIS_DOWN as exc:  # OSError: a connect that timed out too
                error = exc
            finally:
                self._conn = None
                if conn is not None:
                    await conn.disconnect(nowait=True)
            log.warning("listener_disconnected", retry_in_s=delay, error=str(error))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _read(self, conn: AbstractConnection) -> None:
        """Dispatch replies until the connection fails.

        One timeout per quiet window, not one per read: redis-py's ``get_message`` arms a timer
        for every message, which cost as much as the rest of the relay. A window with no reply
        sends a PING; a second one in a row means the connection is dead (a half-open TCP
        connection never errors by itself)."""
        pinged = False
        while True:
            before = self._reads
            try:
                async with asyncio.timeout(self._idle_s):
                    while True:
                        try:
                            reply = await conn.read_response(disconnect_on_error=False)
                        except ResponseError as exc:  # a refused SUBSCRIBE (an ACL without that channel)
                            log.error("listener_command_refused", error=str(exc))
                            continue
                        self._reads += 1
                        self._dispatch(reply)
            except TimeoutError:
                if self._reads != before:
                    pinged = False
                elif pinged:
                    raise RedisTimeoutError(f"the pub/sub connection did not answer a PING in {self._idle_s} s") \
                        from None
                else:
                    await conn.send_command("PING", check_health=False)
                    pinged = True

    def _dispatch(self, reply: list) -> None:
        kind, channel = reply[0], reply[1]
        if kind in (b"message", b"smessage"):
            jobs = self._relays.get(channel)
            if jobs is None:
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(reply[2])
                return
            # One line per event, each "<job id> <event JSON>" (JSON holds no raw newline). A job
            # nobody here follows any longer (its request ended) is skipped.
            for line in reply[2].split(b"\n"):
                job, _, event = line.partition(b" ")
                for queue in jobs.get(job, ()):
                    queue.put_nowait(event)
        elif kind == b"sunsubscribe" and (channel in self._queues or channel in self._relays):
            # Dropped by the server (its slot moved), or our SUNSUBSCRIBE crossing a new subscriber's
            # SSUBSCRIBE: subscribe again; the confirmation then sends RESYNC (messages may be gone).
            task = asyncio.get_running_loop().create_task(self._send("SSUBSCRIBE", channel))
            self._resubscribing.add(task)
            task.add_done_callback(self._resubscribing.discard)
        elif kind in (b"subscribe", b"ssubscribe"):
            future = self._confirmations.pop(channel, None)
            if future is not None and not future.done():
                future.set_result(None)
            else:
                # A re-subscription after a reconnect: messages published meanwhile are gone.
                # From this confirmation on, every event arrives live; every earlier one is in the log.
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(RESYNC)
                for queues in self._relays.get(channel, {}).values():
                    for queue in queues:
                        queue.put_nowait(RESYNC)

    @asynccontextmanager
    async def subscribe(self, channel: str, *, timeout_s: float = 2.0, wait: bool = True
                        ) -> AsyncIterator[asyncio.Queue[bytes]]:
        """Yield a queue of this channel's messages, once Redis has confirmed the subscription.

        ``wait=False`` yields as soon as the SUBSCRIBE is sent, so the caller can enqueue meanwhile
        (a round trip less before the job starts); it then awaits :meth:`confirmed` and reads the
        log, which holds every event published before the subscription took effect."""
        key = channel.encode()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        first = key not in self._queues
        self._queues.setdefault(key, set()).add(queue)
        try:
            if first:
                self._confirmations.setdefault(key, asyncio.get_running_loop().create_future())
                await self._send(self._sub, key)
            if wait:
                await self.confirmed(channel, timeout_s=timeout_s)
            yield queue
        finally:
            subscribers = self._queues.get(key)
            if subscribers is not None:
                subscribers.discard(queue)
                if not subscribers:
                    del self._queues[key]
                    await self._unsubscribe(key)

    @asynccontextmanager
    async def follow(self, channel: str, job_id: str, *, timeout_s: float = 2.0, wait: bool = True
                     ) -> AsyncIterator[Inbox]:
        """Yield a queue of job ``job_id``'s events from relay ``channel`` (subscribing to it the
        first time), once Redis has confirmed that subscription; ``wait=False`` as in :meth:`subscribe`.
        The job's record must name ``channel`` (JobStore.enqueue / JobStore.add_follower) for events to come."""
        key, job = channel.encode(), job_id.encode()
        queue = Inbox()
        jobs = self._relays.get(key)
        first = jobs is None
        if jobs is None:
            # Registered before the SUBSCRIBE is sent: a reconnect meanwhile subscribes it too.
            jobs = self._relays[key] = {}
            self._confirmations.setdefault(key, asyncio.get_running_loop().create_future())
        jobs.setdefault(job, set()).add(queue)
        try:
            if first:
                await self._send(self._sub, key)
            if wait:
                await self.confirmed(channel, timeout_s=timeout_s)
            yield queue
        finally:
            followers = jobs.get(job)
            if followers is not None:
                followers.discard(queue)
                if not followers:
                    del jobs[job]

    async def keep(self, channel: str) -> None:
        """Subscribe relay ``channel`` as :meth:`follow` does, with no job followed yet: a model's
        every token shard's channel is subscribed at its first job, so a job in another shard
        later is followed live from its first event (no read of its log)."""
        key = channel.encode()
        if key in self._relays:
            return
        self._relays[key] = {}
        self._confirmations.setdefault(key, asyncio.get_running_loop().create_future())
        await self._send(self._sub, key)

    async def confirmed(self, channel: str, *, timeout_s: float = 2.0) -> None:
        """Return once the subscription to ``channel`` is in effect; QueueUnavailable after
        ``timeout_s`` (no pub/sub connection)."""
        future = self._confirmations.get(channel.encode())
        if future is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise QueueUnavailable("the queue's pub/sub connection is not available") from None

    def in_effect(self, channel: str) -> bool:
        """Whether the subscription to ``channel`` is confirmed on the current connection: a job
        followed from now on misses no live event (or, should the connection drop, gets RESYNC)."""
        key = channel.encode()
        followed = key in self._relays or key in self._queues
        return followed and self._conn is not None and key not in self._confirmations

    async def _unsubscribe(self, key: bytes) -> None:
        self._confirmations.pop(key, None)
        await self._send(self._unsub, key)

    async def _send(self, *command: bytes | str) -> None:
        conn = self._conn
        # Checked right before the send, in the same step: redis-py would silently reconnect a
        # dropped connection, and subscribe on a socket nobody reads.
        if conn is None or not conn.is_connected:
            return  # the reader is (re)connecting: it subscribes every channel in _queues then
        try:
            await conn.send_command(*command, check_health=False)
        except REDIS_DOWN:
            pass  # the reader sees the broken connection too, and reconnects
