"""Queue and event operations on Redis, used by both the API and the workers.

The API enqueues and reads; a worker picks, claims, publishes and finishes. Every write that must
be all-or-nothing is one Lua script (called through its packer in shared/scripts.py) or one
MULTI; every command here names keys through :class:`shared.keys.Keys` only. A worker's presence
(heartbeat, control channel, peers) is shared/registry.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, get_args

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import eventlog, scripts
from shared.cluster import is_cluster, publish
from shared.codec import decode_event, decode_request, encode, job_from_hash, job_to_hash
from shared.durability import NOT_DURABLE, Durability
from shared.errors import (
    DeadlineExceeded,
    JobCancelled,
    NotDurable,
    Overloaded,
    QueueRefused,
    RateLimited,
    ServiceError,
)
from shared.events import Done, Error, Event, Tokens
from shared.keys import GROUP, LEVELS, Keys, shard_of
from shared.redis_memory import MemoryGuard
from shared.schemas import GenerationRequest, JobError, JobGroup, JobRecord, JobResult, Usage, estimate_tokens
from shared.tenants import DEFAULT_TENANT, TenantConfig, today

__all__ = ["Queue", "Delivery", "DeliveryState", "Picked", "Swap", "Outbound", "Flushed", "Held", "now_ms", "level_of"]

log = structlog.get_logger()
T = TypeVar("T")
_ids = msgspec.json.Decoder(list[int])
_groups = msgspec.json.Decoder(JobGroup)
_event_list = msgspec.json.Decoder(list[Event])
# XAUTOCLAIM calls per level per reclaim (a worker reclaims at most once a second).
RECLAIM_CALLS_PER_LEVEL = 3


def now_ms() -> float:
    return round(time.time() * 1000, 3)


def level_of(priority: int | None) -> int:
    """The queue level of a request priority: 0 (the default and anything more urgent) to 2.
    None (a request that never passed the API's admission, which sets it) is the default."""
    return min(max(priority or 0, 0), LEVELS - 1)


async def _unless(stop: asyncio.Event, call: Callable[[], Awaitable[T]]) -> T | None:
    """``call()``'s result, or None once ``stop`` is set first (then it is cancelled; redis-py
    drops a connection whose command was cancelled, so none is left half-read)."""
    if stop.is_set():
        return None
    work, stopped = asyncio.ensure_future(call()), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if work.done():
        return work.result()
    # Cancelled again until it ends: on Python 3.11 redis-py sends through asyncio.wait_for, which
    # drops a cancel that arrives just as the send completes, and a blocking read would then wait
    # out its whole block (seen in CI: a stopped worker still reading 20 s later).
    while not work.done():
        work.cancel()
        await asyncio.wait({work}, timeout=0.1)
    if not work.cancelled():
        work.exception()  # it ended on its own meanwhile (say, Redis went away): nothing to report
    return None


DeliveryState = Literal["run", "cancelled", "dead", "expired", "missing", "finished", "invalid"]
"""What a worker does with a delivered entry, as claim.lua decided (``invalid``: the record's
request does not decode here):

- ``run``: start it (the claim took ownership: attempt + 1, worker = us);
- ``cancelled``, ``expired`` (its deadline passed), ``dead`` (out of deliveries), ``invalid``:
  owned too, and ended at once with that error, never reaching the engine;
- ``missing`` (no record: expired or never written), ``finished`` (the entry outlived its job):
  nothing to own; the entry is only cleared."""
_STATES: frozenset[str] = frozenset(get_args(DeliveryState))
_OWNED: frozenset[str] = frozenset({"run", "cancelled", "dead", "expired"})  # states whose row holds the request


@dataclass(slots=True)
class Delivery:
    """One queue entry handed to a worker, after it was claimed (claim.lua)."""

    entry_id: bytes
    job_id: str
    state: DeliveryState
    request: GenerationRequest | None
    queued_at: float
    attempt: int
    level: int = 0
    """The priority level whose stream the entry is in."""
    deadline: float | None = None
    last_seq: int = 0
    """The job's last logged event: > 0 when an earlier attempt already published events."""
    reclaimed: bool = False
    traceparent: str = ""
    """The W3C ``traceparent`` of the request that queued the job ("": none; tracing off)."""
    lost_worker: str = ""
    """The worker of the previous attempt when that attempt was lost (died or stalled)."""
    lost_started: float = 0.0
    """When that lost attempt started (epoch ms)."""
    tenant: str = ""
    relay: str = ""
    """The relay channels its record named at the claim (take.lua puts them in its shard's fence)."""
    preemptions: int = 0
    """How often it gave its slot to a job owed it before this claim (preempt.lua)."""

    @property
    def held(self) -> Held:
        """What the worker holding it renews and hands back."""
        return Held(self.job_id, self.entry_id, self.attempt, self.level)


class Logged(NamedTuple):
    """A job's logged events (:meth:`Queue.read_log`)."""

    events: list[Event]
    prompt_ids: list[int] | None = None
    """The prompt's token ids, logged with an attempt's first event (None: not among those read)."""


@dataclass(slots=True)
class Outbound:
    """One event on its way out, with what a terminal event also writes to the record."""

    job_id: str
    event: Event | None = None
    """The event; None for a token event that travels as ``data`` only (a worker's usual one)."""
    entry_id: bytes | None = None  # set on terminal events: the queue entry to ack and delete
    result: JobResult | None = None
    first_token_at: float | None = None
    attempt: int = 0
    """The writer's attempt: the write happens only while (worker, attempt) still own the job.
    0 = unfenced (a delivery whose record is missing)."""
    dead: bool = False  # terminal only: also record the job in the dead-letter stream
    prompt_ids: list[int] | None = None
    """The prompt's token ids, logged with the event (an attempt's first) so a successor can continue."""
    level: int = 0  # terminal only: the level stream that holds ``entry_id``
    usage: Usage | None = None
    """Terminal only: what the job used, when no ``result`` says so (it failed or never ran);
    None: not known. Its tenant's fair share and usage are charged it."""
    log: bytes | None = None
    """Terminal only: the job's whole event log, this event included, in compact form
    (shared/eventlog.py), to replace the per-event stream once the job has ended; None keeps
    the stream (its writer does not hold every event of the job)."""
    history: Sequence[bytes] = ()
    """The writer's attempt's events so far as JSON (this one among them), seqs ``history_from``
    + 1 on: what it writes again when a failover took some back from the log (:attr:`Flushed.gaps`)."""
    history_from: int = 0
    history_prompt_ids: list[int] | None = None
    """The prompt's token ids event ``history_from`` + 1 carried (``prompt_ids`` of the attempt's
    first event), written again with it when a failover took it back."""
    data: bytes = b""
    """The event's JSON, encoded once by its writer; empty: encoded here from ``event``."""
    seq: int = 0
    """The event's seq (read from ``event`` when it is given)."""

    def __post_init__(self) -> None:
        if self.event is not None:
            self.seq = self.event.seq
            if not self.data:
                self.data = encode(self.event)

    @property
    def terminal(self) -> bool:
        return self.event is not None and not isinstance(self.event, Tokens)


class Flushed(NamedTuple):
    """What a flush (:meth:`Queue.flush`) could not write."""

    lost: list[str]
    """Jobs whose events were refused: the worker lost them (a peer owns them now)."""
    gaps: dict[str, int]
    """Jobs whose log holds fewer events than came before their first one in the batch (a
    failover took the last ones back), with how many it holds: none of their events in the batch
    was written."""


@dataclass(slots=True)
class Held:
    """A job a worker holds: what its lease renewal and hand-back need."""

    job_id: str
    entry_id: bytes
    attempt: int
    level: int = 0


class Picked(NamedTuple):
    """What one pick (:meth:`Queue.pick`) gave a worker."""

    deliveries: list[Delivery]
    """The jobs picked, read and claimed (none: nobody waits)."""
    tops: list[bytes]
    """When nothing was picked, each level's newest waiting entry then: where
    :meth:`Queue.wait_for_work` waits from, so a job queued since wakes it at once."""
    acked: int | None = None
    """A pick with ``confirm=False``: the claims are made, not yet confirmed (their token shards
    not fenced, under LLMQ_DURABILITY not yet on the replicas). The caller must
    :meth:`Queue.confirm` them, passing this (the replicas' confirmations so far), before it writes
    anything about the jobs. None: confirmed, or nothing picked."""
    wake_ms: int = 0
    """With affinity: ms until a job this pick left for another worker becomes anyone's, the
    longest :meth:`Queue.wait_for_work` may block (no new entry will wake it for that job); 0: none."""


class Swap(NamedTuple):
    """What one preemption check (:meth:`Queue.preempt`) gave a worker with no free slot."""

    victim: str | None
    """The running job that gives way (handed back: it waits again); None: none does."""
    deliveries: list[Delivery]
    """The job picked into its slot, claimed but not confirmed (as :meth:`Queue.pick` with
    ``confirm=False``: :meth:`Queue.confirm` it, passing ``acked``, before writing about it)."""
    acked: int
    waiting: bool
    """A job waits (none gave way for it now): the worker asks again soon."""
    tops: list[bytes]
    """Nothing waits: each level's newest waiting entry (:attr:`Picked.tops`)."""


class Queue:
    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, idempotency_ttl_s: int = 86400,
                 usage_days: int = 400, durability: Durability = NOT_DURABLE, memory: MemoryGuard | None = None,
                 recent_jobs: int = 10000):
        self.redis = redis
        self.recent_jobs = recent_jobs
        """How many of a model's newest jobs its recent stream keeps (LLMQ_RECENT_JOBS; 0: none)."""
        self.keys = keys
        self.durability = durability
        """What an admission waits for before it is acknowledged (LLMQ_DURABILITY)."""
        self.memory = memory
        """Refuses admissions above LLMQ_REDIS_MEMORY_WATERMARK; None: Redis's own limit only."""
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.usage_ttl_s = usage_days * 86400
        self.scripts = scripts.Scripts(redis)
        self._reclaim_from: dict[str, bytes | str] = {}  # per level queue: where the next scan resumes

    @property
    def sharded(self) -> bool | None:
        """Whether live events go out with SPUBLISH; decided on first use (shared/scripts.py)."""
        return self.scripts.sharded

    # --- both sides ---------------------------------------------------------------------------

    async def ensure_group(self, model: str) -> None:
        """Create every level's consumer group from the stream's start ('0'), so jobs queued
        before any worker existed are still delivered."""
        for queue in self.keys.queues(model):
            try:
                await self.redis.xgroup_create(queue, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

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
            pipe.hmget(self.keys.ending(model, job_id), "status", "field", "payload", "finished_at")
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

    async def save_group(self, group: JobGroup, ttl_s: int) -> None:
        await self.redis.set(self.keys.group(group.model, group.id), encode(group), ex=ttl_s)

    async def get_group(self, model: str, group_id: str) -> JobGroup | None:
        raw = await self.redis.get(self.keys.group(model, group_id))
        return _groups.decode(raw) if raw else None

    async def note(self, model: str, job_id: str, fields: dict[str, str | int]) -> bool:
        """Set ``fields`` on the job record if it still exists (never recreates an expired one)."""
        return bool(await self.scripts.run(scripts.set_if_exists(self.keys.job(model, job_id), fields)))

    async def read_events(self, model: str, job_id: str, after_seq: int = 0) -> list[Event]:
        """The job's logged events with sequence number > ``after_seq``, in order: from the
        stream while it runs, rebuilt from the compact log once it has ended (one script, so
        never half of each; the same events and bytes either way)."""
        return (await self.read_log(model, job_id, after_seq)).events

    async def read_log(self, model: str, job_id: str, after_seq: int = 0) -> Logged:
        """:meth:`read_events`, with the prompt's token ids when the events read include the
        one that carried them (a running job's log: what a continuation needs)."""
        kind, *reply = await self.scripts.run(scripts.read_log(self.keys.events(model, job_id), after_seq + 1))
        if kind == b"s":
            events, prompt_ids = [], None
            for _, fields in reply[0]:
                events.append(decode_event(fields[1]))
                if len(fields) > 2 and fields[2] == b"p":  # the attempt's first event: 'e', event, 'p', ids
                    prompt_ids = _ids.decode(fields[3])
            return Logged(events, prompt_ids)
        # No stream in the shard: ended and settled (the compact log is in the record; settle.lua
        # drops the stream only after finish.lua put it there), or an older worker's string.
        compact, result = (reply[0], None) if kind == b"c" else (None, None)
        if compact is None or eventlog.needs_result(compact):
            held, result = await self.redis.hmget(self.keys.job(model, job_id), "log", "result")
            compact = compact if compact is not None else held
        if compact is None:
            return Logged([])
        if eventlog.needs_result(compact) and not result:
            return Logged([])  # the record expired a moment before its log (same TTL): the job is gone
        return Logged([e for e in _event_list.decode(eventlog.expand(compact, result or None)) if e.seq > after_seq])

    # --- API side -----------------------------------------------------------------------------

    async def enqueue(self, record: JobRecord, idempotency_key: str | None = None, *,
                      max_queued: int = 2**62, relay: str | None = None, tenant: TenantConfig | None = None) -> str:
        """Write the record and queue the job on its priority level, atomically, to wait for its
        tenant's turn (read.lua picks); returns the owning job id (an earlier job's id when
        ``idempotency_key`` was seen before). Raises :class:`Overloaded` when the model already has
        ``max_queued`` unfinished jobs, :class:`RateLimited` when the job's tenant is past one of
        the limits in ``tenant`` (its settings). ``relay``: the relay channel (Keys.relay) of the
        API process following the job, where its events go."""
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
        call = scripts.enqueue(
            self.keys, model, record.id, name, idempotency=idempotency_key, idempotency_ttl=self.idempotency_ttl_s,
            max_depth=max_queued, level=level_of(record.request.priority), weight=config.weight,
            max_running=limit(config.max_running), max_queued=limit(config.max_queued),
            tokens_per_minute=limit(config.tokens_per_minute), now=now_ms(), recent=self.recent_jobs,
            dialect=record.request.dialect, owner=record.owner, record=[v for pair in fields.items() for v in pair],
            touch=durable)
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
        # Fence the job's token shard at the attempt just taken: its worker writes nothing more.
        shard = shard_of(job_id)
        [(state, last_seq, ending)] = await self.scripts.run(
            scripts.take(self.keys, model, "", [shard], [(job_id, attempt, followers, 0)]))
        if state == b"ended":  # its worker logged its end first: the record says that one
            extra = scripts.Extra.from_ending(dict(zip(ending[::2], ending[1::2], strict=True)))
            await self._finish(model, [(job_id, attempt, extra._replace(entry=""))], [(job_id, False)])
            return False
        if state != b"ok":
            return False
        seq = int(last_seq) + 1
        event = b'{"type":"error","seq":%d,' % seq + event[len(head):]
        # The queue entry stays until a worker reads or reclaims it and finds the job finished
        # (claim.lua), which acks and deletes it.
        extra = scripts.Extra(status="failed", field="error", payload=error)
        flushed = await self.scripts.run(scripts.flush(self.keys, model, writer="", result_ttl=self.result_ttl_s,
                                                       shards=[shard],
                                                       events=[attempt, seq, event, job_id, 0],
                                                       endings=[(0, extra)]))
        if flushed[0] or flushed[1]:
            return False
        await self._finish(model, [(job_id, attempt, extra)], [(job_id, False)])
        return True

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

    # --- worker side --------------------------------------------------------------------------

    async def pick(self, model: str, consumer: str, count: int, max_deliveries: int = 3, *,
                   confirm: bool = True, affinity: scripts.Affinity = scripts.NO_AFFINITY) -> Picked:
        """Pick, read and claim up to ``count`` new jobs, the most urgent level first, by fair
        share between tenants within a level: read.lua, one round trip, never blocking. Ask only
        for as many as can start now (the engine's free slots): nothing is claimed that could not.
        Then the claims are confirmed (:meth:`confirm`: their token shards fenced, and under
        LLMQ_DURABILITY held until the replicas have them); ``confirm=False`` leaves that to the
        caller (:attr:`Picked.acked`), which may start the engine meanwhile but must write nothing
        until then. ``affinity``: leave jobs a moment for the workers that hold their keys
        (read.lua)."""
        call = scripts.read(self.keys, model, consumer, count, now=now_ms(), max_failed=max_deliveries,
                            affinity=affinity)
        while True:  # again at once while it stops early on waiting jobs that had already ended
            (rows, tops, more, wake_ms), acked = await self._run(call)
            if rows or not more:
                break
        deliveries = self._deliveries([(int(level), entry_id, job.decode()) for level, entry_id, job, _ in rows],
                                      [state for *_, state in rows], reclaimed=False)
        if not deliveries:
            return Picked(deliveries, tops, wake_ms=wake_ms)
        if not confirm:
            return Picked(deliveries, tops, acked=acked, wake_ms=wake_ms)
        return Picked(await self.confirm(model, consumer, deliveries, acked), tops, wake_ms=wake_ms)

    async def preempt(self, model: str, consumer: str, candidates: Sequence[scripts.Candidate], *,
                      max_failed: int, max_preemptions: int) -> Swap:
        """Whether one of ``candidates`` (running jobs of ``consumer``, whose engine has no free
        slot) gives way to a waiting job, and if so the swap, in one round trip (preempt.lua): the
        candidate handed back to wait again, the waiting job picked and claimed in its place."""
        call = scripts.preempt(self.keys, model, consumer, candidates, now=now_ms(), max_failed=max_failed,
                               max_preemptions=max_preemptions)
        (victim, rows, waiting, tops), acked = await self._run(call)
        deliveries = self._deliveries([(int(level), entry_id, job.decode()) for level, entry_id, job, _ in rows],
                                      [state for *_, state in rows], reclaimed=False)
        return Swap(candidates[victim].job_id if victim >= 0 else None, deliveries, acked, bool(waiting), tops)

    async def _run(self, call: scripts.Call) -> tuple[Any, int]:
        """Run a script; under LLMQ_DURABILITY with the WAIT after it: its reply, and the
        confirmations of its writes (0 when nothing is waited for)."""
        if self.durability.wanted:
            return await self.scripts.run_and_wait(call, self.durability)
        return await self.scripts.run(call), 0

    async def confirm(self, model: str, worker: str, deliveries: list[Delivery], acked: int) -> list[Delivery]:
        """Confirm jobs just picked (:meth:`pick`, ``acked``: the replicas' confirmations of its
        claims): fence their token shards (:meth:`_take`, which drops a job a peer took meanwhile),
        and hold them until their claims are on the replicas LLMQ_DURABILITY wants (renewing their
        leases meanwhile, with a WAIT after each renewal); the jobs still ours.

        Nothing is written about a job before then (its engine request may run meanwhile, its
        events wait: workers/runner.py): a claim only the primary holds may be a job only the
        primary holds, one whose admission was refused (503) for want of replicas. Were the primary
        to die, the client's retry would queue it again on the new one, and it would run twice."""
        deliveries = await self._take(model, worker, deliveries)
        if not deliveries or acked >= self.durability.wanted:
            return deliveries
        log.warning("claims_not_durable", model=model, jobs=len(deliveries), wanted=self.durability.wanted)
        while deliveries:
            held = [d.held for d in deliveries]
            lost, acked = await self.scripts.run_and_wait(self._renewal(model, worker, held), self.durability)
            gone = {held[int(i)].job_id for i in lost}
            deliveries = [d for d in deliveries if d.job_id not in gone]
            if acked >= self.durability.wanted:
                log.info("claims_durable", model=model, jobs=len(deliveries), confirmed=acked)
                break
        return deliveries

    async def wait_for_work(self, model: str, tops: list[bytes], block_ms: int,
                            stop: asyncio.Event | None = None) -> bool:
        """Block until a job is queued after ``tops`` (:attr:`Picked.tops`: so one queued since the
        pick wakes this at once), for at most ``block_ms``, holding nothing; True when one was.
        Every idle worker wakes; the next pick gives the job to one. ``stop`` set ends the wait at
        once, with False (a worker told to drain must not wait out LLMQ_BLOCK_MS first)."""

        def read() -> Awaitable[list]:
            return self.redis.xread(dict(zip(self.keys.waitings(model), tops, strict=True)), count=1, block=block_ms)

        return bool(await read() if stop is None else await _unless(stop, read))

    async def reclaim(self, model: str, consumer: str, count: int, lease_ms: int, *,
                      max_deliveries: int = 3, exclude: frozenset[str] = frozenset()) -> list[Delivery]:
        """Take over up to ``count`` entries whose lease expired (idle > ``lease_ms``: their
        worker stopped renewing) and claim them; ``exclude`` = jobs this consumer already runs.

        XAUTOCLAIM's min-idle check is atomic, so two reclaimers never get the same entry; the
        claim bumps the job's attempt, which fences off the previous owner.
        """
        taken: list[tuple[int, bytes, str]] = []
        for level, queue in enumerate(self.keys.queues(model)):  # the most urgent level first
            # Each call scans at most 10 x COUNT PEL entries (XAUTOCLAIM's attempts limit; seen on
            # 6.2.14 and 7.x). Bounded work per reclaim, resumed where the last one stopped: a PEL of 10,000
            # live leases costs a few calls a second, and an expired entry anywhere in it is found
            # within a few passes (restarting at 0-0 each time would never look past the head).
            cursor: bytes | str = self._reclaim_from.get(queue, "0-0")
            for _ in range(RECLAIM_CALLS_PER_LEVEL):
                if len(taken) >= count:
                    break
                cursor, claimed, *_ = await self.redis.xautoclaim(
                    queue, GROUP, consumer, lease_ms, start_id=cursor, count=count - len(taken)
                )
                self._reclaim_from[queue] = cursor
                for entry_id, fields in claimed:
                    if fields is None or b"job" not in fields:
                        # A deleted entry still referenced by the PEL (Redis < 7): clear the reference.
                        if entry_id is not None:
                            await self.redis.xack(queue, GROUP, entry_id)
                        continue
                    taken.append((level, entry_id, fields[b"job"].decode()))
                if cursor in (b"0-0", "0-0"):
                    break
        mine = [j for _, _, j in taken if j in exclude]
        if mine:  # our own jobs (a stalled loop let the lease lapse): XAUTOCLAIM renewed them
            log.warning("lease_lapsed_own_jobs", jobs=mine)
        fresh = [t for t in taken if t[2] not in exclude]
        return await self._claim(model, consumer, fresh, max_deliveries, reclaimed=True)

    async def take_over(self, model: str, dead: str, consumer: str, count: int, *,
                        max_deliveries: int = 3) -> list[Delivery]:
        """Move up to ``count`` entries that consumer ``dead`` holds to ``consumer``, the most
        urgent level first, and claim them (takeover.lua: atomic per level, so two takers never
        share an entry; claim_taken.lua bumps each job's attempt, the fence). A level where ``dead`` is
        left holding nothing loses the consumer too."""
        taken: list[tuple[int, bytes, str]] = []
        for level, queue in enumerate(self.keys.queues(model)):
            rows = await self.scripts.run(scripts.takeover(queue, dead, consumer, count - len(taken)))
            taken += [(level, entry_id, job.decode()) for entry_id, job in rows]
        return await self._claim(model, consumer, taken, max_deliveries, reclaimed=True)

    async def _claim(self, model: str, consumer: str, entries: list[tuple[int, bytes, str]], max_deliveries: int,
                     *, reclaimed: bool) -> list[Delivery]:
        if not entries:
            return []
        states = await self.scripts.run(scripts.claim_taken(self.keys, model, consumer, [job for _, _, job in entries],
                                                            now=now_ms(), max_failed=max_deliveries))
        return await self._take(model, consumer, self._deliveries(entries, states, reclaimed=reclaimed))

    # --- token shards (Keys.fence): the second slot of every job --------------------------------

    def _groups(self, job_ids: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """How to split a call over jobs by token shard: per call (shards, [(item index, index into
        shards)]). On a Cluster one call per shard (one slot each); a single Redis takes them all
        in one call."""
        calls: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
        one = not is_cluster(self.redis)
        for i, job_id in enumerate(job_ids):
            shard = shard_of(job_id)
            shards, items = calls.setdefault(0 if one else shard, ([], []))
            if shard not in shards:
                shards.append(shard)
            items.append((i, shards.index(shard)))
        return list(calls.values())

    async def _each(self, calls: list[scripts.Call]) -> list[Any]:
        """Run calls on different shards side by side (on a Cluster, different masters)."""
        if not calls:
            return []
        if len(calls) == 1:
            return [await self.scripts.run(calls[0])]
        # Every call answered before any error is raised: a retry of the batch never races a call
        # of the try before it.
        replies = await asyncio.gather(*(self.scripts.run(call) for call in calls), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return list(replies)

    async def _take(self, model: str, worker: str, deliveries: list[Delivery]) -> list[Delivery]:
        """Fence the token shards of jobs just claimed at their new attempt (take.lua), and learn
        where each log ends (:attr:`Delivery.last_seq`). A job whose shard a later attempt holds
        is dropped (a peer claimed it meanwhile); one whose terminal event is logged and whose
        record was not ended (its writer died between the two) is ended now, from its ending, and
        handed on as ``finished``."""
        owned = [d for d in deliveries if d.state not in ("missing", "finished")]
        if not owned:
            return deliveries
        groups = self._groups([d.job_id for d in owned])
        replies = await self._each([
            scripts.take(self.keys, model, worker, shards, [(owned[i].job_id, owned[i].attempt, owned[i].relay, at)
                                                    for i, at in items])
            for shards, items in groups])
        lost: set[str] = set()
        ended: list[tuple[str, int, scripts.Extra]] = []
        for (_, items), reply in zip(groups, replies, strict=True):
            for (i, _), (state, last_seq, ending) in zip(items, reply, strict=True):
                d = owned[i]
                d.last_seq = int(last_seq)
                if state == b"lost":
                    lost.add(d.job_id)
                elif state == b"ended":
                    extra = scripts.Extra.from_ending(dict(zip(ending[::2], ending[1::2], strict=True)))
                    ended.append((d.job_id, d.attempt, extra._replace(entry=d.entry_id, entry_level=d.level)))
                    d.state = "finished"
        if ended:
            log.warning("job_end_recovered", jobs=[job_id for job_id, _, _ in ended])
            await self._finish(model, ended, [(job_id, False) for job_id, _, _ in ended])
        return [d for d in deliveries if d.job_id not in lost]

    async def _finish(self, model: str, items: list[tuple[str, int, scripts.Extra]],
                      settle: list[tuple[str, bool]]) -> list[int]:
        """Write what events say to their records (finish.lua), then settle the shards of the jobs
        that ended (``settle``: job id, whether its record now holds its compact log). Returns the
        indexes of the items refused."""
        ending = any(extra.status for _, _, extra in items)  # today's date only for items that end a job
        refused = await self.scripts.run(scripts.finish(
            self.keys, model, result_ttl=self.result_ttl_s, now=now_ms(), day=today() if ending else "",
            day_ttl=self.usage_ttl_s, items=items))
        gone = {items[int(i)][0] for i in refused}
        settle = [(job_id, drop) for job_id, drop in settle if job_id not in gone]
        if settle:
            groups = self._groups([job_id for job_id, _ in settle])
            await self._each([scripts.settle(self.keys, model, shards, [(settle[i][0], at, settle[i][1])
                                                                        for i, at in items])
                              for shards, items in groups])
        return [int(i) for i in refused]

    def _deliveries(self, entries: list[tuple[int, bytes, str]], states: list, *, reclaimed: bool) -> list[Delivery]:
        """Deliveries from entries (level, entry id, job id) and their claim rows (claim.lua)."""
        deliveries = []
        for (level, entry_id, job_id), row in zip(entries, states, strict=True):
            raw, request, queued_at, attempt, deadline, trace, lost, lost_started, tenant, relay, preemptions = row
            state: DeliveryState = raw.decode()
            assert state in _STATES, f"claim.lua returned an unknown state {state!r}"
            decoded = None
            if state in _OWNED:
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
                relay=relay.decode() if relay else "",
                reclaimed=reclaimed,
                level=level,
                deadline=float(deadline) if deadline else None,
                traceparent=trace.decode() if trace else "",
                lost_worker=lost.decode() if lost else "",
                lost_started=float(lost_started) if lost_started else 0.0,
                tenant=tenant.decode() if tenant else "",
                preemptions=preemptions,
            ))
        return deliveries

    async def ack(self, model: str, entry_id: bytes, level: int = 0) -> None:
        """Ack and delete one delivered entry that needs no answer (its job is gone or finished)."""
        # One script rather than MULTI: as atomic, and redis-py's Cluster pipeline has no MULTI.
        await self.scripts.run(scripts.ack(self.keys.queue(model, level), entry_id))

    async def renew(self, model: str, worker: str, held: list[Held], *, hand_back_idle_ms: int | None = None
                    ) -> list[str]:
        """Renew the leases of ``held`` (reset their idle time; fenced). With ``hand_back_idle_ms``
        instead hand them back: idle set past the lease, so a peer's next reclaim takes them at
        once. Returns the job ids this worker no longer owns."""
        if not held:
            return []
        lost = await self.scripts.run(self._renewal(model, worker, held, hand_back_idle_ms))
        gone = [held[int(i)].job_id for i in lost]
        if hand_back_idle_ms:  # and out of their token shards' fences: nothing more from us
            await self._each([scripts.release(self.keys, model, h.job_id, worker, h.attempt) for h in held
                              if h.job_id not in gone])
        return gone

    def _renewal(self, model: str, worker: str, held: list[Held], hand_back_idle_ms: int | None = None
                 ) -> scripts.Call:
        return scripts.renew(self.keys, model, worker, [(h.job_id, h.entry_id, h.attempt, h.level) for h in held],
                             idle_ms=hand_back_idle_ms or 0, hand_back=bool(hand_back_idle_ms))

    async def flush(self, model: str, batch: list[Outbound], worker: str = "") -> Flushed:
        """Publish a batch of events: per token shard, per event XADD to the event log and one
        PUBLISH per following API process's relay channel (or per event to the job's own live
        channel when none is recorded), in one script per shard (flush.lua; a single Redis runs one
        for every shard). An attempt's first event carries the prompt's token ids into its log
        entry, so whoever reads a token there can continue after it. A first token's time goes to
        its record (finish.lua, in the model's slot) beside those calls, and a job's end after them
        (the record's outcome, its compact log, XACK + XDEL), then the shards of the jobs that ended
        are settled (settle.lua). Each event is written only while its attempt holds its job's shard fence
        (take.lua), and only right after the event before it: a job whose log lacks events before
        its first one here (a failover took them back) writes none of them (:attr:`Flushed.gaps`).

        A terminal event is logged (with its ending, Keys.ending) before its record says so: a
        writer that dies between leaves the record to the job's next claimer (Queue._take), and
        every follower has the end from the log. ``worker``: the writer, whose fence entries (take.lua)
        its events must find.
        """
        groups = self._groups([out.job_id for out in batch])
        calls = []
        extras: dict[int, scripts.Extra] = {}
        for i, out in enumerate(batch):
            if out.first_token_at is not None or out.terminal:
                extras[i] = self._extra(out)  # the usual token event needs none
        for shards, items in groups:
            events: list[Any] = []  # flat: the packer's five values per event, built in this one pass
            endings: list[tuple[int, scripts.Extra]] = []
            prompts: list[tuple[int, bytes]] = []
            for n, (i, at) in enumerate(items):
                out = batch[i]
                events += (out.attempt, out.seq, out.data, out.job_id, at)  # the bytes its writer encoded
                if i in extras and extras[i].status:
                    endings.append((n, extras[i]))
                if out.prompt_ids is not None:
                    prompts.append((n, encode(out.prompt_ids)))
            calls.append(scripts.flush(self.keys, model, writer=worker, result_ttl=self.result_ttl_s, shards=shards,
                                       events=events, endings=endings, prompts=prompts))
        # A first token's time goes to its record side by side with the logs (off the path to the
        # client's first token); nothing depends on the order of the two.
        notes = [i for i, extra in extras.items() if not extra.status]
        if notes:
            calls.append(scripts.finish(self.keys, model, result_ttl=self.result_ttl_s, now=now_ms(), day="",
                                        day_ttl=self.usage_ttl_s,
                                        items=[(batch[i].job_id, batch[i].attempt, extras[i]) for i in notes]))
        replies = await self._each(calls)
        lost_jobs = {batch[notes[int(n)]].job_id for n in replies.pop()} if notes else set()
        lost_at: set[int] = set()
        gaps: dict[str, int] = {}
        whole: set[int] = set()
        for (_, items), (lost, gap, complete) in zip(groups, replies, strict=True):
            lost_at.update(items[int(n)][0] for n in lost)
            gaps.update({batch[items[int(n)][0]].job_id: int(logged) for n, logged in zip(gap[::2], gap[1::2],
                                                                                          strict=True)})
            whole.update(items[int(n)][0] for n in complete)
        lost_jobs.update(batch[i].job_id for i in lost_at)
        ends = [i for i, extra in extras.items() if extra.status and i not in lost_at and batch[i].job_id not in gaps]
        if ends:
            items = []
            for i in ends:
                extra = extras[i]
                if i not in whole:
                    extra = extra._replace(compact="")  # the log holds more than this writer knows of
                items.append((batch[i].job_id, batch[i].attempt, extra))
            # A refusal here is a peer's claim between the two steps: that claimer ends the record
            # from the logged ending (Queue._take), so the job is not lost to anyone.
            refused = await self._finish(model, items, [(job_id, bool(extra.compact)) for job_id, _, extra in items])
            if refused:
                log.info("flush_end_left_to_claimer", worker=worker, jobs=[items[n][0] for n in refused])
        return Flushed(sorted(lost_jobs), gaps)

    @classmethod
    def _extra(cls, out: Outbound) -> scripts.Extra:
        """What an event writes beyond the log and the live path."""
        status, field, payload = cls._terminal(out)
        # The tokens its tenant is charged: the result's usage, else what the worker counted (-1: unknown).
        usage = out.result.usage if out.result is not None else out.usage
        return scripts.Extra(
            first_token_at="" if out.first_token_at is None else out.first_token_at,
            status=status, field=field, payload=payload, entry=out.entry_id or "", entry_level=out.level,
            dead="1" if out.dead else "", compact=out.log or "", prompt_tokens=usage.prompt_tokens if usage else -1,
            generated_tokens=usage.completion_tokens if usage else -1, finished_at=now_ms() if status else "")

    @staticmethod
    def _terminal(out: Outbound) -> tuple[str, str, bytes | str]:
        match out.event:
            case Done():
                return "done", "result", encode(out.result or JobResult())
            case Error(code=code, message=message, status=status) as error:
                outcome = "cancelled" if isinstance(error.exception(), JobCancelled) else "failed"
                return outcome, "error", encode(JobError(code=code, message=message, status=status))
            case Tokens() | None:
                return "", "", ""
