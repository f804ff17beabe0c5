"""Queue and event operations on Redis, used by both the API and the workers.

The API enqueues and reads; a worker claims, publishes and finishes. Every write that must be
all-or-nothing is one Lua script or one MULTI; every command here names keys through
:class:`shared.keys.Keys` only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.codec import decode_event, decode_request, encode, job_from_hash, job_to_hash
from shared.events import Done, Error, Event
from shared.keys import GROUP, Keys
from shared.schemas import GenerationRequest, JobError, JobRecord, JobResult

__all__ = ["Queue", "Delivery", "Outbound", "Held", "now_ms"]

log = structlog.get_logger()
_ids = msgspec.json.Decoder(list[int])


def now_ms() -> float:
    return round(time.time() * 1000, 3)


def _script(name: str) -> str:
    return resources.files("shared").joinpath("lua", name).read_text()


@dataclass(slots=True)
class Delivery:
    """One queue entry handed to a worker, after the start script ran."""

    entry_id: bytes
    job_id: str
    state: str  # "run", "cancelled", "dead", "missing", "finished" (see start.lua) or "invalid"
    request: GenerationRequest | None
    queued_at: float
    attempt: int
    last_seq: int = 0
    """The job's last logged event: > 0 when an earlier attempt already published events."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids as an earlier attempt's engine saw them (for continuation)."""
    reclaimed: bool = False


@dataclass(slots=True)
class Outbound:
    """One event on its way out, with what a terminal event also writes to the record."""

    job_id: str
    event: Event
    entry_id: bytes | None = None  # set on terminal events: the queue entry to ack and delete
    result: JobResult | None = None
    first_token_at: float | None = None
    attempt: int = 0
    """The writer's attempt: the write happens only while (worker, attempt) still own the job.
    0 = unfenced (a delivery whose record is missing)."""
    dead: bool = False  # terminal only: also record the job in the dead-letter stream
    prompt_ids: list[int] | None = None  # stored with the event so a successor can continue


@dataclass(slots=True)
class Held:
    """A job a worker holds: what its lease renewal and hand-back need."""

    job_id: str
    entry_id: bytes
    attempt: int


class Queue:
    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, idempotency_ttl_s: int = 86400):
        self.redis = redis
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._enqueue = redis.register_script(_script("enqueue.lua"))
        self._start = redis.register_script(_script("start.lua"))
        self._flush = redis.register_script(_script("flush.lua"))
        self._renew = redis.register_script(_script("renew.lua"))
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

    async def read_new(self, model: str, consumer: str, count: int, block_ms: int,
                       max_deliveries: int = 3) -> list[Delivery]:
        """Take up to ``count`` new entries (never more than the engine has free slots) and claim
        them in one round trip."""
        reply = await self.redis.xreadgroup(
            GROUP, consumer, {self.keys.queue(model): ">"}, count=count, block=block_ms
        )
        if not reply:
            return []
        entries = [(entry_id, fields[b"job"].decode()) for entry_id, fields in reply[0][1]]
        return await self._claim(model, consumer, entries, max_deliveries, reclaimed=False)

    async def reclaim(self, model: str, consumer: str, count: int, lease_ms: int, *,
                      max_deliveries: int = 3, exclude: frozenset[str] = frozenset()) -> list[Delivery]:
        """Take over up to ``count`` entries whose lease expired (idle > ``lease_ms``: their
        worker stopped renewing) and claim them; ``exclude`` = jobs this consumer already runs.

        XAUTOCLAIM's min-idle check is atomic, so two reclaimers never get the same entry; the
        claim bumps the job's attempt, which fences off the previous owner.
        """
        queue = self.keys.queue(model)
        taken: list[tuple[bytes, str]] = []
        cursor: bytes | str = "0-0"
        for _ in range(10):  # bounded: a huge PEL is scanned over several calls, not one
            cursor, claimed, *_ = await self.redis.xautoclaim(
                queue, GROUP, consumer, lease_ms, start_id=cursor, count=count - len(taken)
            )
            for entry_id, fields in claimed:
                if fields is None or b"job" not in fields:
                    # A deleted entry still referenced by the PEL (Redis < 7): clear the reference.
                    if entry_id is not None:
                        await self.redis.xack(queue, GROUP, entry_id)
                    continue
                taken.append((entry_id, fields[b"job"].decode()))
            if len(taken) >= count or cursor in (b"0-0", "0-0"):
                break
        mine = [(e, j) for e, j in taken if j in exclude]
        if mine:  # our own jobs (a stalled loop let the lease lapse): XAUTOCLAIM renewed them
            log.warning("lease_lapsed_own_jobs", jobs=[j for _, j in mine])
        fresh = [(e, j) for e, j in taken if j not in exclude]
        return await self._claim(model, consumer, fresh, max_deliveries, reclaimed=True)

    async def _claim(self, model: str, consumer: str, entries: list[tuple[bytes, str]], max_deliveries: int,
                     *, reclaimed: bool) -> list[Delivery]:
        if not entries:
            return []
        keys: list[str] = []
        for _, job_id in entries:
            keys += [self.keys.job(model, job_id), self.keys.events(model, job_id)]
        states = await self._start(keys=keys, args=[consumer, now_ms(), max_deliveries])
        deliveries = []
        for (entry_id, job_id), (state, request, queued_at, attempt, last_seq, prompt_ids) in zip(
            entries, states, strict=True
        ):
            state = state.decode()
            decoded = None
            if state in ("run", "cancelled", "dead"):
                try:
                    decoded = decode_request(request)
                except msgspec.ValidationError as exc:
                    # A request no worker can run (written by a buggy or newer API): fail that job,
                    # never the worker that read it.
                    log.warning("job_request_invalid", job_id=job_id, error=str(exc))
                    state = "invalid"
            deliveries.append(Delivery(
                entry_id=entry_id,
                job_id=job_id,
                state=state,
                request=decoded,
                queued_at=float(queued_at),
                attempt=int(attempt),
                last_seq=int(last_seq),
                prompt_ids=_ids.decode(prompt_ids) if prompt_ids else None,
                reclaimed=reclaimed,
            ))
        return deliveries

    async def ack(self, model: str, entry_id: bytes) -> None:
        """Ack and delete one delivered entry that needs no answer (its job is gone or finished)."""
        queue = self.keys.queue(model)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(queue, GROUP, entry_id)
        pipe.xdel(queue, entry_id)
        await pipe.execute()

    async def renew(self, model: str, worker: str, held: list[Held], *, hand_back_idle_ms: int | None = None
                    ) -> list[str]:
        """Renew the leases of ``held`` (reset their idle time; fenced). With ``hand_back_idle_ms``
        instead hand them back: idle set past the lease, so a peer's next reclaim takes them at
        once. Returns the job ids this worker no longer owns."""
        if not held:
            return []
        args: list[str | bytes | int] = [worker, hand_back_idle_ms or 0, 1 if hand_back_idle_ms else 0]
        for h in held:
            args += [h.entry_id, h.attempt]
        lost = await self._renew(
            keys=[self.keys.queue(model), *(self.keys.job(model, h.job_id) for h in held)], args=args
        )
        return [held[int(i)].job_id for i in lost]

    async def flush(self, model: str, batch: list[Outbound], worker: str = "") -> list[str]:
        """Publish a batch of events in ONE round trip (flush.lua): per event PUBLISH to the live
        channel and XADD to the event log; per terminal event also the record update and XACK +
        XDEL. Each event is written only while ``worker`` still owns its job at the event's
        attempt. Returns the ids of jobs whose events were refused: the worker lost them.

        One script is atomic, and legal on Cluster: every key of one model shares its hash tag.
        """
        keys = [self.keys.queue(model), self.keys.dead(model)]
        args: list[str | bytes | int | float] = [worker, self.result_ttl_s, now_ms()]
        for out in batch:
            keys += [self.keys.job(model, out.job_id), self.keys.events(model, out.job_id)]
            status, field, payload = self._terminal(out)
            args += [
                out.attempt, out.event.seq, encode(out.event), self.keys.live(model, out.job_id),
                "" if out.first_token_at is None else out.first_token_at, status, field, payload,
                out.entry_id or "", out.job_id if out.dead else "",
                encode(out.prompt_ids) if out.prompt_ids is not None else "",
            ]
        lost = await self._flush(keys=keys, args=args)
        return sorted({batch[int(i)].job_id for i in lost})

    @staticmethod
    def _terminal(out: Outbound) -> tuple[str, str, bytes | str]:
        event = out.event
        if isinstance(event, Done):
            return "done", "result", encode(out.result or JobResult())
        if isinstance(event, Error):
            status = "cancelled" if event.code == "cancelled" else "failed"
            return status, "error", encode(JobError(code=event.code, message=event.message, status=event.status))
        return "", "", ""
