"""Queue and event operations on Redis, used by both the API and the workers.

The API enqueues and reads; a worker claims, publishes and finishes. Every write that must be
all-or-nothing is one Lua script or one MULTI; every command here names keys through
:class:`shared.keys.Keys` only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.codec import decode_event, decode_request, encode, job_from_hash, job_to_hash
from shared.events import Done, Error, Event
from shared.keys import GROUP, Keys
from shared.schemas import GenerationRequest, JobError, JobRecord, JobResult

__all__ = ["Queue", "Delivery", "Outbound", "now_ms"]


def now_ms() -> float:
    return round(time.time() * 1000, 3)


def _script(name: str) -> str:
    return resources.files("shared").joinpath("lua", name).read_text()


@dataclass(slots=True)
class Delivery:
    """One queue entry handed to a worker, after the start script ran."""

    entry_id: bytes
    job_id: str
    state: str  # "run", "missing" or "cancelled"
    request: GenerationRequest | None
    queued_at: float
    attempt: int


@dataclass(slots=True)
class Outbound:
    """One event on its way out, with what a terminal event also writes to the record."""

    job_id: str
    event: Event
    entry_id: bytes | None = None  # set on terminal events: the queue entry to ack and delete
    result: JobResult | None = None
    first_token_at: float | None = None


class Queue:
    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, idempotency_ttl_s: int = 86400):
        self.redis = redis
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._enqueue = redis.register_script(_script("enqueue.lua"))
        self._start = redis.register_script(_script("start.lua"))
        self._cancel = redis.register_script(_script("cancel.lua"))

    # --- both sides ---------------------------------------------------------------------------

    async def ensure_group(self, model: str) -> None:
        """Create the consumer group from the stream's start ('0'), so jobs queued before any
        worker existed are still delivered."""
        try:
            await self.redis.xgroup_create(self.keys.queue(model), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def get_job(self, model: str, job_id: str) -> JobRecord | None:
        raw = await self.redis.hgetall(self.keys.job(model, job_id))
        return job_from_hash(raw) if raw else None

    async def read_events(self, model: str, job_id: str, after_seq: int = 0) -> list[Event]:
        """The job's logged events with sequence number > ``after_seq``, in order."""
        entries = await self.redis.xrange(self.keys.events(model, job_id), min=f"{after_seq + 1}-0")
        return [decode_event(fields[b"e"]) for _, fields in entries]

    # --- API side -----------------------------------------------------------------------------

    async def enqueue(self, record: JobRecord, idempotency_key: str | None = None) -> str:
        """Write the record and queue the job atomically; returns the owning job id (an earlier
        job's id when ``idempotency_key`` was seen before)."""
        keys = [self.keys.job(record.model, record.id), self.keys.queue(record.model)]
        if idempotency_key:
            keys.append(self.keys.idempotency(record.model, idempotency_key))
        args: list[bytes | str | int] = [record.id, self.idempotency_ttl_s]
        for field, value in job_to_hash(record).items():
            args += [field, value]
        owner = await self._enqueue(keys=keys, args=args)
        return owner.decode()

    async def cancel(self, model: str, job_id: str) -> str | None:
        """Flag the job cancelled and tell its worker. Returns the status it had, or None."""
        reply = await self._cancel(keys=[self.keys.job(model, job_id)])
        if not reply:
            return None
        status, worker = (v.decode() for v in reply)
        if status == "running" and worker:
            await self.redis.publish(self.keys.worker_control(worker), job_id)
        return status

    # --- worker side --------------------------------------------------------------------------

    async def read_new(self, model: str, consumer: str, count: int, block_ms: int) -> list[Delivery]:
        """Take up to ``count`` new entries (never more than the engine has free slots) and claim
        them in one round trip."""
        reply = await self.redis.xreadgroup(
            GROUP, consumer, {self.keys.queue(model): ">"}, count=count, block=block_ms
        )
        if not reply:
            return []
        entries = [(entry_id, fields[b"job"].decode()) for entry_id, fields in reply[0][1]]
        states = await self._start(
            keys=[self.keys.job(model, job_id) for _, job_id in entries], args=[consumer, now_ms()]
        )
        deliveries = []
        for (entry_id, job_id), (state, request, queued_at, attempt) in zip(entries, states, strict=True):
            state = state.decode()
            deliveries.append(Delivery(
                entry_id=entry_id,
                job_id=job_id,
                state=state,
                request=decode_request(request) if state == "run" else None,
                queued_at=float(queued_at),
                attempt=int(attempt),
            ))
        return deliveries

    async def flush(self, model: str, batch: list[Outbound]) -> None:
        """Publish a batch of events in ONE round trip: per event PUBLISH to the live channel and
        XADD to the event log; per terminal event also the record update and XACK + XDEL.

        MULTI makes each flush all-or-nothing; it is legal on Cluster because every key of one
        model shares the model's hash tag.
        """
        ttl = self.result_ttl_s
        pipe = self.redis.pipeline(transaction=True)
        for out in batch:
            data = encode(out.event)
            events_key = self.keys.events(model, out.job_id)
            job_key = self.keys.job(model, out.job_id)
            pipe.publish(self.keys.live(model, out.job_id), data)
            # Entry id = sequence number: XRANGE from "<n+1>-0" resumes exactly after event n.
            pipe.xadd(events_key, {"e": data}, id=f"{out.event.seq}-0")
            if out.event.seq == 1:
                # A safety TTL from the first write, so a crashed worker cannot leave orphans.
                pipe.expire(events_key, ttl)
            if out.first_token_at is not None:
                pipe.hset(job_key, "first_token_at", out.first_token_at)
            if isinstance(out.event, (Done, Error)):
                self._finish(pipe, model, out)
        await pipe.execute()

    def _finish(self, pipe, model: str, out: Outbound) -> None:
        event = out.event
        job_key = self.keys.job(model, out.job_id)
        fields: dict[str, str | bytes | float] = {"finished_at": now_ms()}
        if isinstance(event, Done):
            fields["status"] = "done"
            fields["result"] = encode(out.result or JobResult())
        else:
            assert isinstance(event, Error)
            fields["status"] = "cancelled" if event.code == "cancelled" else "failed"
            fields["error"] = encode(JobError(code=event.code, message=event.message, status=event.status))
        pipe.hset(job_key, mapping=fields)
        pipe.expire(job_key, self.result_ttl_s)
        pipe.expire(self.keys.events(model, out.job_id), self.result_ttl_s)
        if out.entry_id is not None:
            queue = self.keys.queue(model)
            pipe.xack(queue, GROUP, out.entry_id)
            pipe.xdel(queue, out.entry_id)

