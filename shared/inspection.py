"""Reading one model's queue: every figure anything reports about it, in one pipeline.

``llmq-status`` and ``/metrics`` (both through :func:`shared.status.snapshot`), housekeeping's
sweep and :meth:`shared.queue.JobStore.depth` all read the queue through :func:`read_queue`; each
uses the figures it needs. It only reads, so it is safe against a live deployment.

A level's jobs are in two streams: the waiting stream holds those waiting for their tenant's turn
(the fair-share pick moves each to the queue stream), and the queue stream those picked, until
they end (a finished job's entry is deleted: flush.lua, ack.lua). Together they are the level's
unfinished jobs. The consumer group's pending entries are the delivered ones, so the rest waits.
"""

from __future__ import annotations

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.keys import GROUP, Keys

__all__ = ["Consumer", "LevelReading", "QueueReading", "read_queue", "ORPHAN_SCAN"]

ORPHAN_SCAN = 1000
"""At most this many lapsed leases are listed per level: enough to count and age them; more
than that many orphans is an outage whatever the exact number."""


class Consumer(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer of a level's group (a worker id, or a dead worker's)."""

    name: str
    pending: int
    idle_ms: int


class LevelReading(msgspec.Struct, frozen=True, kw_only=True):
    level: int
    stream: str
    exists: bool
    length: int
    """Entries in both streams: every unfinished job on the level."""
    pending: int
    """Delivered and unfinished: the group's pending entries (0 without a group yet)."""
    oldest_ms: int | None
    """Enqueue time (epoch ms, the entry id's) of the oldest unfinished job; None when there is none."""
    orphaned: int = 0
    """With ``lease_ms``: pending entries idle past the lease (their worker stopped renewing)."""
    oldest_orphan_ms: int = 0
    """With ``lease_ms``: the longest an orphan has gone without its worker (ms since delivery)."""
    consumers: tuple[Consumer, ...] = ()
    """With ``lease_ms``: the group's consumers."""

    @property
    def waiting(self) -> int:
        """Queued and not yet delivered to any worker. (On Redis < 7 a deleted entry may stay in
        the pending list until the next reclaim clears it, so pending can exceed the length.)"""
        return max(0, self.length - self.pending)


class QueueReading(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    levels: list[LevelReading]
    """Every priority level, most urgent first, whether its stream exists or not."""
    dead_letters: int
    ready_workers: int
    """Workers whose registration had not expired at ``now_ms``."""

    @property
    def depth(self) -> int:
        return sum(level.length for level in self.levels)


def _id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def _plain(reply):
    """A reply that must not be an error (the pipeline hands errors back in place)."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def _of_group(reply, empty):
    """A group command's reply; ``empty`` when the level has no stream or no group yet (no
    worker ever started on it)."""
    if isinstance(reply, ResponseError) and ("NOGROUP" in str(reply) or "no such key" in str(reply)):
        return empty
    return _plain(reply)


async def read_queue(redis: Redis, keys: Keys, model: str, *, now_ms: float,
                     lease_ms: int | None = None) -> QueueReading:
    """One round trip: per level the stream's existence, length, oldest entry and pending count
    (and, with ``lease_ms``, its lapsed leases and consumers); the dead letters; the ready workers."""
    streams = keys.queues(model)
    pipe = redis.pipeline(transaction=False)
    for stream, waiting in zip(streams, keys.waitings(model), strict=True):
        pipe.xlen(waiting)
        pipe.xrange(waiting, count=1)
        pipe.exists(stream)
        pipe.xlen(stream)
        pipe.xrange(stream, count=1)
        pipe.xpending(stream, GROUP)
        if lease_ms is not None:
            pipe.xpending_range(stream, GROUP, min="-", max="+", count=ORPHAN_SCAN, idle=lease_ms)
            pipe.xinfo_consumers(stream, GROUP)
    pipe.xlen(keys.dead(model))
    pipe.zcount(keys.workers(model), now_ms, "+inf")
    replies = iter(await pipe.execute(raise_on_error=False))
    levels = []
    for level, stream in enumerate(streams):
        held, first_held = _plain(next(replies)), _plain(next(replies))
        exists, length, first = _plain(next(replies)), _plain(next(replies)), _plain(next(replies))
        oldest = min((_id_ms(f[0][0]) for f in (first, first_held) if f), default=None)
        pending = _of_group(next(replies), {"pending": 0})["pending"]
        orphans, consumers = [], []
        if lease_ms is not None:
            orphans, consumers = _of_group(next(replies), []), _of_group(next(replies), [])
        levels.append(LevelReading(
            level=level, stream=stream, exists=bool(exists or held), length=length + held, pending=pending,
            oldest_ms=oldest, orphaned=len(orphans),
            oldest_orphan_ms=max((o["time_since_delivered"] for o in orphans), default=0),
            consumers=tuple(Consumer(name=c["name"].decode(), pending=c["pending"], idle_ms=c["idle"])
                            for c in consumers),
        ))
    dead, ready = _plain(next(replies)), _plain(next(replies))
    return QueueReading(model=model, levels=levels, dead_letters=dead, ready_workers=ready)
