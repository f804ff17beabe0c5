"""The API's face of the queue: the job store. It writes a job's record and queues it
(:meth:`JobStore.enqueue`), reads records, groups and logs, and cancels, expires and deletes jobs.
Housekeeping uses it too, as the API does (batch lines, webhooks).

Every write that must be all-or-nothing is one Lua script (called through its packer in
shared/scripts.py); every command here names keys through :class:`shared.keys.Keys` only. A job's
end in place of its worker is the fenced writer's (shared/queue/writer.py).
"""

from __future__ import annotations

import math

import msgspec
import structlog
from redis.asyncio import Redis

from shared import scripts
from shared.cluster import publish
from shared.codec import encode, job_from_hash, job_to_hash
from shared.durability import NOT_DURABLE, Durability
from shared.errors import (
    DeadlineExceeded,
    JobCancelled,
    NotDurable,
    Overloaded,
    QueueRefused,
    RateLimited,
    ServiceError,
    SloUnattainable,
)
from shared.events import Error, Event
from shared.keys import LEVELS, Keys
from shared.queue.base import Side
from shared.queue.writer import now_ms
from shared.redis import reply
from shared.redis_memory import MemoryGuard
from shared.schemas import JobError, JobGroup, JobRecord, estimate_prompt_tokens, estimate_tokens
from shared.slo import UNKNOWN, Capacity, Standing
from shared.tenants import DEFAULT_TENANT, TenantConfig

__all__ = ["JobStore", "level_of"]


log = structlog.get_logger()
_groups = msgspec.json.Decoder(JobGroup)


class _Priority(msgspec.Struct):
    """The one field of a queued request its standing needs: its level."""

    priority: int | None = None


_priority = msgspec.json.Decoder(_Priority)


def level_of(priority: int | None) -> int:
    """The queue level of a request priority: 0 (the default and anything more urgent) to 2.
    None (a request that never passed the API's admission, which sets it) is the default."""
    return min(max(priority or 0, 0), LEVELS - 1)


class JobStore(Side):
    """The job store on ``redis``: what the API (and housekeeping) reads and writes of jobs."""

    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, idempotency_ttl_s: int = 86400,
                 usage_days: int = 400, durability: Durability = NOT_DURABLE, memory: MemoryGuard | None = None,
                 recent_jobs: int = 10000):
        super().__init__(redis, keys, result_ttl_s=result_ttl_s, usage_days=usage_days, durability=durability)
        self.recent_jobs = recent_jobs
        """How many of a model's newest jobs its recent stream keeps (LLMQ_RECENT_JOBS; 0: none)."""
        self.memory = memory
        """Refuses admissions above LLMQ_REDIS_MEMORY_WATERMARK; None: Redis's own limit only."""
        self.idempotency_ttl_s = idempotency_ttl_s

    # --- reads --------------------------------------------------------------------------------

    async def depth(self, model: str) -> int:
        """Unfinished jobs (queued or running) over every level: finished entries are deleted."""
        from shared.inspection import read_queue

        return (await read_queue(self.redis, self.keys, model, now_ms=now_ms())).depth

    async def get_job(self, model: str, job_id: str) -> JobRecord | None:
        [record] = await self.get_jobs(model, [job_id])
        return record

    async def get_jobs(self, model: str, job_ids: list[str]) -> list[JobRecord | None]:
        """Records of one model, in order (None: missing or expired): one round trip, and up to two
        more for those still running, whose end may be logged already (:meth:`_ended`)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(model, job_id))
        raws = await pipe.execute()
        running = [i for i, raw in enumerate(raws) if raw.get(b"status") == b"running"]
        if running:
            await self._ended(model, [job_ids[i] for i in running], [raws[i] for i in running])
        return [job_from_hash(raw) if raw else None for raw in raws]

    async def _ended(self, model: str, job_ids: list[str], raws: list[dict[bytes, bytes]]) -> None:
        """A job's end is logged in its token shard (with its ending: Keys.ending) a moment before
        its record says so (finish.lua, the model's slot), and its followers have it from the log
        at once. So that a client who has read the end never reads "running" after it, the records
        of ``job_ids`` still running take their ending's status and result or error, when there is
        one (in place)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.ending(model, job_id), ["status", "field", "payload", "finished_at"])
        settled = []
        for n, (raw, (status, field, payload, finished_at)) in enumerate(zip(raws, await pipe.execute(), strict=True)):
            if status:
                raw[b"status"], raw[field] = status, payload
                if finished_at:
                    raw[b"finished_at"] = finished_at
            else:
                settled.append(n)
        # No ending: still running, or ended and settled since the record was read (finish.lua
        # then settle.lua, both after that read). Read after the ending's absence, the record
        # says which.
        if settled:
            pipe = self.redis.pipeline(transaction=False)
            for n in settled:
                pipe.hgetall(self.keys.job(model, job_ids[n]))
            for n, raw in zip(settled, await pipe.execute(), strict=True):
                raws[n].clear()
                raws[n].update(raw)

    async def position(self, model: str, job_id: str, capacity: Capacity) -> Standing | None:
        """Where a waiting job stands (shared/slo.py): how many jobs of its model are estimated to
        start before it and, from the model's warm ``capacity``, in how long it should start. None
        when it does not wait (it runs, it ended, or it is gone)."""
        status, tenant, queued_at, due, preempted_at, request = await reply(self.redis.hmget(
            self.keys.job(model, job_id), ["status", "tenant", "queued_at", "first_token_deadline", "preempted_at",
                                           "request"]))
        if status != b"queued" or request is None:
            return None
        score = scripts.line_score(float(queued_at or 0), float(due) if due else None,
                                   float(preempted_at) if preempted_at else None)
        level = level_of(_priority.decode(request).priority)
        ahead, wait_ms = await self.scripts.run(scripts.position(
            self.keys, model, (tenant or b"").decode() or DEFAULT_TENANT, level, score, capacity))
        return Standing(position=int(ahead), eta_s=round(wait_ms / 1000, 1) if wait_ms >= 0 else None)

    async def save_group(self, group: JobGroup, ttl_s: int) -> None:
        await self.redis.set(self.keys.group(group.model, group.id), encode(group), ex=ttl_s)

    async def get_group(self, model: str, group_id: str) -> JobGroup | None:
        raw = await self.redis.get(self.keys.group(model, group_id))
        return _groups.decode(raw) if raw else None

    async def note(self, model: str, job_id: str, fields: dict[str, scripts.Value]) -> bool:
        """Set ``fields`` on the job record if it still exists (never recreates an expired one)."""
        return bool(await self.scripts.run(scripts.set_if_exists(self.keys.job(model, job_id), fields)))

    async def read_events(self, model: str, job_id: str, after_seq: int = 0) -> list[Event]:
        """The job's logged events with sequence number > ``after_seq``, in order: from the
        stream while it runs, rebuilt from the compact log once it has ended (one script, so
        never half of each; the same events and bytes either way)."""
        return (await self.read_log(model, job_id, after_seq)).events

    # --- writes -------------------------------------------------------------------------------

    async def enqueue(self, record: JobRecord, idempotency_key: str | None = None, *,
                      max_queued: int = 2**62, relay: str | None = None, tenant: TenantConfig | None = None,
                      capacity: Capacity = UNKNOWN, slo_margin_ms: int = 0) -> str:
        """Write the record and queue the job on its priority level, atomically, to wait for its
        tenant's turn (read.lua picks); returns the owning job id (an earlier job's id when
        ``idempotency_key`` was seen before). Raises :class:`Overloaded` when the model already has
        ``max_queued`` unfinished jobs, :class:`RateLimited` when the job's tenant is past one of
        the limits in ``tenant`` (its settings), :class:`SloUnattainable` when its TTFT is
        predicted past its SLO less ``slo_margin_ms`` (LLMQ_SLO_MARGIN_MS) from the model's
        ``capacity`` (shared/slo.py; unknown: never).
        ``relay``: the relay channel (Keys.relay) of the API process following the job, where its
        events go."""
        model, name = record.model, record.tenant or DEFAULT_TENANT
        config = tenant or TenantConfig()
        if not record.tenant or not record.estimate:  # a record not made by JobRecord.new
            record = msgspec.structs.replace(record, tenant=name, estimate=estimate_tokens(record.request))

        def limit(value: int | None) -> int:
            return -1 if value is None else value

        fields = job_to_hash(record)
        if relay:
            fields["relay"] = relay
        job_key = self.keys.job(model, record.id)
        if self.memory is not None and not await self.memory.admits(job_key):
            log.info("redis_memory_watermark", model=model, watermark=self.memory.watermark)
            raise QueueRefused(f"The queue is at its memory limit (over {self.memory.watermark:.0%} of Redis's "
                               "maxmemory): no new jobs until running ones finish; retry shortly")
        durable = self.durability.wanted > 0
        request = record.request
        # What the queue and the engine may take of the SLO: the rest is the request's way in and out.
        budget_ms = max(1, request.slo.ttft_ms - slo_margin_ms) if request.slo and request.slo.ttft_ms else None
        prefill_ms = (estimate_prompt_tokens(request) / capacity.prefill_tps * 1000 if capacity.prefill_tps > 0
                      else 0.0)
        call = scripts.enqueue(
            self.keys, model, record.id, name, idempotency=idempotency_key, idempotency_ttl=self.idempotency_ttl_s,
            max_depth=max_queued, level=level_of(record.request.priority), weight=config.weight,
            max_running=limit(config.max_running), max_queued=limit(config.max_queued),
            tokens_per_minute=limit(config.tokens_per_minute), now=now_ms(), recent=self.recent_jobs,
            dialect=record.request.dialect, owner=record.owner, record=[v for pair in fields.items() for v in pair],
            touch=durable, queued_at=record.queued_at, first_token_deadline=record.first_token_deadline,
            slo_ttft_ms=budget_ms, prefill_ms=prefill_ms,
            capacity=capacity)
        owner, acked = await self._run(call)
        match owner:
            case [b"full", depth]:
                log.info("queue_full", model=model, depth=depth, limit=max_queued)
                raise Overloaded(f"Model {model} is overloaded: {depth} requests are queued (limit {max_queued}); "
                                 "retry later")
            case [b"queued", running, waiting]:
                log.info("tenant_queue_full", model=model, tenant=name, running=running, waiting=waiting)
                raise RateLimited(f"Too many requests in flight for this tenant on model {model}: {running} running "
                                  f"and {waiting} waiting (max_running {config.max_running}, max_queued "
                                  f"{config.max_queued}); retry when one has finished")
            case [b"slo", predicted]:
                assert request.slo is not None and budget_ms is not None  # only a job with an SLO is refused so
                log.info("slo_unattainable", model=model, tenant=name, predicted_ttft_ms=predicted,
                         slo_ttft_ms=request.slo.ttft_ms)
                raise SloUnattainable(
                    f"Model {model} cannot meet this request's TTFT SLO of {request.slo.ttft_ms} ms: the work queued "
                    f"ahead of it is predicted to take {predicted} ms to its first token, and {slo_margin_ms} ms "
                    "are kept for its way in and out; retry later",
                    retry_after_s=max(1, math.ceil((predicted - budget_ms) / 1000)))
            case [b"tokens", used, retry]:
                log.info("tenant_tokens_exceeded", model=model, tenant=name, used=used, retry_after_s=retry)
                raise RateLimited(f"Rate limit reached for this tenant on model {model}: {used} tokens used in the "
                                  f"last minute (limit {config.tokens_per_minute}); retry in {retry} s",
                                  retry_after_s=int(retry))
        if acked < self.durability.wanted:
            log.warning("not_durable", model=model, job_id=owner.decode(), confirmed=acked,
                        wanted=self.durability.wanted)
            held = ("on disk" if self.durability.fsync
                    else f"on {acked} of the {self.durability.replicas} replicas it needs")
            raise NotDurable(f"The job was not {held} within {self.durability.timeout_ms} ms; it may still run: "
                             "retry with the same Idempotency-Key")
        return owner.decode()

    async def add_follower(self, model: str, job_id: str, channel: str) -> bool:
        """Publish the job's events from now on to relay ``channel`` too (add_follower.lua); False
        when the job has no record."""
        if not await self.scripts.run(scripts.add_follower(self.keys, model, job_id, channel)):
            return False
        # Then in its token shard's fence, where its writer's flushes read the followers (a job not
        # claimed yet has no entry: take.lua copies the record's followers at its claim).
        await self.scripts.run(scripts.follow(self.keys, model, job_id, channel))
        return True

    async def expire(self, model: str, job_id: str, *, grace_ms: int, now: ServiceError | None = None) -> bool:
        """End the job with ``deadline_exceeded`` if its deadline passed (plus ``grace_ms`` when it
        is running: its worker ends it first) and it is still unfinished. With ``now`` (the error to
        end it with) it ends at once if unfinished, deadline or not. True when this ended it."""
        exc = now or DeadlineExceeded("the request's deadline passed before it finished")
        event = encode(Error.of(exc, seq=0))
        head = b'{"type":"error","seq":0,'
        assert event.startswith(head)  # expire.lua writes the same bytes with the real seq
        error = encode(JobError(code=exc.code, message=exc.message, status=exc.status))
        taken = await self.scripts.run(scripts.expire(self.keys, model, job_id, now=now_ms(), grace_ms=grace_ms,
                                                      at_once=now is not None))
        if not taken:
            return False
        attempt, followers = int(taken[0]), taken[1].decode()
        # The queue entry stays until a worker reads or reclaims it and finds the job finished
        # (claim.lua), which acks and deletes it.
        return await self.writer.end_fenced(model, job_id, attempt, followers,
                                            lambda seq: b'{"type":"error","seq":%d,' % seq + event[len(head):],
                                            scripts.Extra(status="failed", field="error", payload=error))

    async def cancel(self, model: str, job_id: str) -> str | None:
        """Flag the job cancelled and tell its worker. Returns the status it had, or None."""
        reply = await self.scripts.run(scripts.cancel(self.keys.job(model, job_id)))
        if not reply:
            return None
        status, worker = (v.decode() for v in reply)
        if status == "running" and worker:
            # Plain pub/sub even on a Redis 7 Cluster: the worker listens on whichever node it chose.
            await publish(self.redis, self.keys.worker_control(worker), job_id)
        return status

    async def delete(self, model: str, job_id: str) -> bool:
        """Forget a job (the Responses API's DELETE). One still unfinished is ended first, fenced,
        as ``cancelled`` (expire.lua: its followers get that event and end; its worker, told to
        stop, can write nothing more); then its record and its log are deleted, so every later read
        is a 404. A queue entry left behind is acked by the worker that reads it (claim.lua:
        missing). False when there was no record."""
        status = await self.cancel(model, job_id)
        if status is None:
            return False
        if status in ("queued", "running"):
            await self.expire(model, job_id, grace_ms=0, now=JobCancelled("the response was deleted"))
        await self.redis.delete(self.keys.job(model, job_id))
        await self.redis.delete(self.keys.events(model, job_id))  # in its token shard: another slot
        return True
