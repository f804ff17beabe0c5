"""The sweeps: every 30 s, prune expired worker registrations, delete the consumers of dead workers
once they hold nothing, and log each model's queue depth, lag, pending count, orphaned jobs and
dead letters; every few seconds, a sample of each model's levels for the console's chart.

The sweep does not reclaim jobs itself. Taking over a job means running it, which needs an engine;
an entry claimed here would only have to be claimed again by a worker, and "claimed but not yet
running" is exactly the state a crash must not leave behind. So live workers reclaim (before
every read, while they have free slots), and this sweep reports what waits for them: entries
whose lease lapsed (``orphaned``) and how old the oldest is, the number to alert on when no
worker has room or none is alive.
"""

from __future__ import annotations

import structlog
from redis.exceptions import ResponseError

from shared.browse import sample
from shared.inspection import QueueReading, read_queue
from shared.keys import GROUP
from shared.queue import now_ms
from workers.housekeeping.housekeeper import Housekeeper

__all__ = ["sweep", "sample_history", "STALE_CONSUMER_MS"]

log = structlog.get_logger()

async def sweep(hk: Housekeeper) -> dict[str, int | float]:
    """Prune lapsed worker registrations, remove dead workers' empty consumers, log the figures.
    ``lag`` is the jobs not yet delivered (stream length minus pending, as /metrics has it)."""
    model = hk.settings.model_name
    pruned = await hk.redis.zremrangebyscore(hk.keys.workers(model), 0, now_ms())
    reading = await read_queue(hk.redis, hk.keys, model, now_ms=now_ms(), lease_ms=int(hk.settings.lease_s * 1000))
    levels = reading.levels  # every priority level, summed
    orphaned = sum(lv.orphaned for lv in levels)
    stats: dict[str, int | float] = {
        "ready_workers": reading.ready_workers, "pruned_workers": pruned,
        "pending": sum(lv.pending for lv in levels), "lag": sum(lv.waiting for lv in levels),
        "queued": reading.depth, "orphaned": orphaned,
        "oldest_orphan_s": round(max(lv.oldest_orphan_ms for lv in levels) / 1000, 1),
        "consumers_removed": await _remove_dead_consumers(hk, reading), "dead_letters": reading.dead_letters,
    }
    # Every 30 s: at info only the first time and when something changed that an operator acts on
    # (workers came or went, jobs wait orphaned, dead letters); the rest is in /metrics anyway.
    notable = (reading.ready_workers, orphaned, reading.dead_letters)
    changed = notable != hk.last_sweep.get(model) or stats["pruned_workers"] or stats["consumers_removed"]
    hk.last_sweep[model] = notable
    (log.info if changed else log.debug)("housekeeping_sweep", model=model, **stats)
    return stats


async def sample_history(hk: Housekeeper) -> None:
    """One sample of every served model's levels into its history (the console's chart,
    shared/browse.py): every SAMPLE_S, so the last ten minutes are there when a page opens."""
    for name in await hk.redis.zrange(hk.keys.models(), 0, -1):
        try:
            await sample(hk.redis, hk.keys, name.decode())
        except ResponseError as exc:  # Redis at its memory limit, a replica: the chart has a gap, no more
            log.debug("history_sample_refused", model=name.decode(), error=str(exc))


# A consumer this idle, holding nothing, whose worker's heartbeat key is gone, belongs to a dead
# worker (consumer names are worker ids). The heartbeat check is what protects a live worker.
STALE_CONSUMER_MS = 10 * 60 * 1000


async def _remove_dead_consumers(hk: Housekeeper, reading: QueueReading) -> int:
    removed = 0
    for level in reading.levels:
        for consumer in level.consumers:
            # DELCONSUMER discards the consumer's pending entries: only ever for one that holds
            # none (XDELCONSUMER answers how many it discarded: counted only when that was 0).
            if consumer.pending == 0 and consumer.idle_ms > STALE_CONSUMER_MS:
                if not await hk.redis.exists(hk.keys.worker(consumer.name)):
                    removed += await hk.redis.xgroup_delconsumer(level.stream, GROUP, consumer.name) == 0
    return removed
