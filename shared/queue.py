"""Queue and event operations on Redis, used by both the API and the workers.

The API enqueues and reads; a worker claims, publishes and finishes. Every write that must be
all-or-nothing is one Lua script or one MULTI; every command here names keys through
:class:`shared.keys.Keys` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

import msgspec
import structlog
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ResponseError

from shared import eventlog
from shared.cluster import node_client, publish, sharded_pubsub, subscribers
from shared.codec import decode_event, decode_request, encode, job_from_hash, job_to_hash
from shared.errors import DeadlineExceeded, JobCancelled, Overloaded, RateLimited, ServiceError
from shared.events import Done, Error, Event, Tokens
from shared.keys import GROUP, LEVELS, Keys
from shared.schemas import GenerationRequest, JobError, JobGroup, JobRecord, JobResult, Usage, estimate_tokens
from shared.tenants import DEFAULT_TENANT, TenantConfig, today

__all__ = ["lua", "Queue", "Delivery", "Outbound", "Held", "now_ms", "level_of"]

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
    work.cancel()
    await asyncio.wait({work})
    if not work.cancelled():
        work.exception()  # it ended on its own meanwhile (say, Redis went away): nothing to report
    return None


@functools.cache
def lua(name: str) -> str:
    """The text of one of the scripts in shared/lua (read once per process), after the text of
    each library (:data:`_LIBRARIES`) it calls: Redis scripts cannot include one another."""
    text = resources.files("shared").joinpath("lua", name).read_text()
    for library, namespace in _LIBRARIES.items():
        if name != library and f"{namespace}." in text:
            text = lua(library) + "\n" + text
    return text


# Functions several scripts share, by the name of the table that holds them.
_LIBRARIES = {"tenants.lua": "Fair", "claim.lua": "Claim"}


def _sharded(source: str) -> str:
    """A script's text with its live-channel PUBLISH made SPUBLISH (sharded pub/sub, Redis >= 7
    Cluster). Legal inside the script: the channel carries the model's hash tag, the script's slot."""
    sharded = source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    assert sharded != source, "the script no longer publishes with redis.call('PUBLISH', ...)"
    return sharded


@dataclass(slots=True)
class Delivery:
    """One queue entry handed to a worker, after the start script ran."""

    entry_id: bytes
    job_id: str
    state: str  # "run", "cancelled", "dead", "expired", "missing", "finished" (start.lua) or "invalid"
    request: GenerationRequest | None
    queued_at: float
    attempt: int
    level: int = 0
    """The priority level whose stream the entry is in."""
    deadline: float | None = None
    last_seq: int = 0
    """The job's last logged event: > 0 when an earlier attempt already published events."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids as an earlier attempt's engine saw them (for continuation)."""
    reclaimed: bool = False
    traceparent: str = ""
    """The W3C ``traceparent`` of the request that queued the job ("": none; tracing off)."""
    lost_worker: str = ""
    """The worker of the previous attempt when that attempt was lost (died or stalled)."""
    lost_started: float = 0.0
    """When that lost attempt started (epoch ms)."""
    tenant: str = ""


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
    level: int = 0  # terminal only: the level stream that holds ``entry_id``
    usage: Usage | None = None
    """Terminal only: what the job used, when no ``result`` says so (it failed or never ran);
    None: not known. Its tenant's fair share and usage are charged it."""
    log: bytes | None = None
    """Terminal only: the job's whole event log, this event included, in compact form
    (shared/eventlog.py), to replace the per-event stream once the job has ended; None keeps
    the stream (its writer does not hold every event of the job)."""


@dataclass(slots=True)
class Held:
    """A job a worker holds: what its lease renewal and hand-back need."""

    job_id: str
    entry_id: bytes
    attempt: int
    level: int = 0


class Queue:
    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, idempotency_ttl_s: int = 86400,
                 usage_days: int = 400):
        self.redis = redis
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.usage_ttl_s = usage_days * 86400
        self._enqueue = redis.register_script(lua("enqueue.lua"))
        self._start = redis.register_script(lua("start.lua"))
        self._flush = redis.register_script(lua("flush.lua"))
        self._renew = redis.register_script(lua("renew.lua"))
        self._cancel = redis.register_script(lua("cancel.lua"))
        self._read = redis.register_script(lua("read.lua"))
        self._expire = redis.register_script(lua("expire.lua"))
        self._ack = redis.register_script(lua("ack.lua"))
        self._read_log = redis.register_script(lua("read_log.lua"))
        self._relay = redis.register_script(lua("relay.lua"))
        self.sharded: bool | None = None
        """Whether live events go out with SPUBLISH; decided on first use (:meth:`_publishing`)."""
        self._note = redis.register_script(lua("note.lua"))
        self._takeover = redis.register_script(lua("takeover.lua"))
        self._reclaim_from: dict[str, bytes | str] = {}  # per level queue: where the next scan resumes

    # --- both sides ---------------------------------------------------------------------------

    async def _publishing(self) -> None:
        """Decide once, before the first script that publishes, between plain and sharded pub/sub
        (shared/cluster.py). A standalone Redis decides without a round trip: plain."""
        if self.sharded is None:
            sharded = await sharded_pubsub(self.redis)
            if sharded:
                self._flush = self.redis.register_script(_sharded(lua("flush.lua")))
                self._expire = self.redis.register_script(_sharded(lua("expire.lua")))
            self.sharded = sharded

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
        raw = await self.redis.hgetall(self.keys.job(model, job_id))
        return job_from_hash(raw) if raw else None

    async def get_jobs(self, model: str, job_ids: list[str]) -> list[JobRecord | None]:
        """Several records of one model in one round trip, in order (None: missing or expired)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(model, job_id))
        return [job_from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def save_group(self, group: JobGroup, ttl_s: int) -> None:
        await self.redis.set(self.keys.group(group.model, group.id), encode(group), ex=ttl_s)

    async def get_group(self, model: str, group_id: str) -> JobGroup | None:
        raw = await self.redis.get(self.keys.group(model, group_id))
        return _groups.decode(raw) if raw else None

    async def note(self, model: str, job_id: str, fields: dict[str, str | int]) -> bool:
        """Set ``fields`` on the job record if it still exists (never recreates an expired one)."""
        args = [v for pair in fields.items() for v in pair]
        return bool(await self._note(keys=[self.keys.job(model, job_id)], args=args))

    async def read_events(self, model: str, job_id: str, after_seq: int = 0) -> list[Event]:
        """The job's logged events with sequence number > ``after_seq``, in order: from the
        stream while it runs, rebuilt from the compact log once it has ended (one script, so
        never half of each; the same events and bytes either way)."""
        kind, *reply = await self._read_log(keys=[self.keys.events(model, job_id), self.keys.job(model, job_id)],
                                            args=[after_seq + 1])
        if kind == b"s":
            return [decode_event(fields[1]) for _, fields in reply[0]]
        compact, result = reply
        if eventlog.needs_result(compact) and not result:
            return []  # the record expired a moment before its log (same TTL): the job is gone
        return [e for e in _event_list.decode(eventlog.expand(compact, result or None)) if e.seq > after_seq]

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
        keys = [self.keys.job(model, record.id), self.keys.tenant(model, name), self.keys.tenants(model),
                self.keys.fair_clock(model)]
        for level in range(LEVELS):
            keys += [self.keys.queue(model, level), self.keys.waiting(model, level), self.keys.fair(model, level)]
        if idempotency_key:
            keys.append(self.keys.idempotency(model, idempotency_key))

        def limit(value: int | None) -> int:
            return -1 if value is None else value

        args: list[bytes | str | int | float] = [
            record.id, self.idempotency_ttl_s, max_queued, LEVELS, level_of(record.request.priority), name,
            repr(config.weight), limit(config.max_running), limit(config.max_queued),
            limit(config.tokens_per_minute), now_ms()]
        for field, value in job_to_hash(record).items():
            args += [field, value]
        if relay:
            args += ["relay", relay]
        owner = await self._enqueue(keys=keys, args=args)
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
        return owner.decode()

    async def relay_to(self, model: str, job_id: str, channel: str) -> bool:
        """Publish the job's events from now on to relay ``channel`` too (relay.lua); False when
        the job has no record."""
        return bool(await self._relay(keys=[self.keys.job(model, job_id)], args=[channel]))

    async def expire(self, model: str, job_id: str, *, grace_ms: int, now: ServiceError | None = None) -> bool:
        """End the job with ``deadline_exceeded`` if its deadline passed (plus ``grace_ms`` when it
        is running: its worker ends it first) and it is still unfinished. With ``now`` (the error to
        end it with) it ends at once if unfinished, deadline or not. True when this ended it."""
        exc = now or DeadlineExceeded("the request's deadline passed before it finished")
        event = encode(Error.of(exc, seq=0))
        head = b'{"type":"error","seq":0,'
        assert event.startswith(head)  # expire.lua writes the same bytes with the real seq
        error = encode(JobError(code=exc.code, message=exc.message, status=exc.status))
        await self._publishing()
        ended = await self._expire(
            keys=[self.keys.job(model, job_id), self.keys.events(model, job_id), self.keys.webhooks(model),
                  *self._metering(model)],
            args=[now_ms(), grace_ms, self.result_ttl_s, self.keys.live(model, job_id), event[len(head):], error,
                  job_id, "1" if now is not None else "0", self.keys.tenant(model, ""), self.usage_ttl_s],
        )
        return bool(ended)

    def _metering(self, model: str) -> list[str]:
        """The keys a job's end updates for its tenant (Fair.ended in tenants.lua): the fair sets,
        the fair clock, today's usage, the usage since the start, the model's token window."""
        return [*self.keys.fairs(model), self.keys.fair_clock(model), self.keys.usage(model, today()),
                self.keys.usage(model), self.keys.tokens(model)]

    async def cancel(self, model: str, job_id: str) -> str | None:
        """Flag the job cancelled and tell its worker. Returns the status it had, or None."""
        reply = await self._cancel(keys=[self.keys.job(model, job_id)])
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
        is a 404. A queue entry left behind is acked by the worker that reads it (start.lua:
        missing). False when there was no record."""
        status = await self.cancel(model, job_id)
        if status is None:
            return False
        if status in ("queued", "running"):
            await self.expire(model, job_id, grace_ms=0, now=JobCancelled("the response was deleted"))
        await self.redis.delete(self.keys.job(model, job_id), self.keys.events(model, job_id))
        return True

    # --- worker side --------------------------------------------------------------------------

    async def read_new(self, model: str, consumer: str, count: int, block_ms: int,
                       max_deliveries: int = 3, *, admit: Callable[[int], int] | None = None,
                       stop: asyncio.Event | None = None) -> list[Delivery]:
        """Pick, read and claim up to ``count`` new jobs (never more than the engine has free
        slots), the most urgent level first, by fair share between tenants within a level.

        read.lua does all three in one script, without blocking; only when nothing waits does the
        read block, on the waiting streams, and then pick once more. ``admit``, called before each
        pick with ``count``, says how many the caller has room for now and holds that many slots
        (its slots may have filled meanwhile: a takeover while the read blocked), so nothing is
        claimed that could not start; called with 0 before blocking, it holds none. ``stop`` set
        ends a blocked read at once, with nothing (a worker told to drain must not wait out
        LLMQ_BLOCK_MS first)."""
        room = admit(count) if admit is not None else count
        if room <= 0:
            return []
        rows, tops = await self._pick(model, consumer, room, max_deliveries)
        if not rows:
            # Nobody waits: sleep until a job is queued after the newest waiting entry read.lua saw
            # (so one queued meanwhile wakes us at once), then pick once more. Every idle worker
            # wakes; the pick gives the job to one.
            waiting = self.keys.waitings(model)
            if admit is not None:
                admit(0)  # hold no slot while blocked: a takeover meanwhile may need them all

            def read() -> Awaitable[list]:
                return self.redis.xread(dict(zip(waiting, tops, strict=True)), count=1, block=block_ms)

            reply = await read() if stop is None else await _unless(stop, read)
            room = admit(count) if admit is not None else count
            if not reply or room <= 0:
                return []
            rows, _ = await self._pick(model, consumer, room, max_deliveries)
        return self._deliveries([(int(level), entry_id, job.decode()) for level, entry_id, job, _ in rows],
                                [state for *_, state in rows], reclaimed=False)

    async def _pick(self, model: str, consumer: str, count: int, max_deliveries: int) -> tuple[list, list[bytes]]:
        """read.lua: up to ``count`` jobs picked by fair share, read and claimed, as (level, entry
        id, job id, start state) rows, and per level the newest waiting entry it saw."""
        keys: list[str] = []
        for level in range(LEVELS):
            keys += [self.keys.queue(model, level), self.keys.waiting(model, level), self.keys.fair(model, level)]
        keys.append(self.keys.fair_clock(model))
        args = [consumer, count, self.keys.tenant(model, ""), self.keys.job(model, ""), self.keys.events(model, ""),
                now_ms(), max_deliveries]
        while True:  # again at once while it stops early on waiting jobs that had already ended
            rows, tops, more = await self._read(keys=keys, args=args)
            if rows or not more:
                return rows, tops

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

    # --- a worker's presence (workers/presence.py) --------------------------------------------

    async def beat(self, model: str, worker: str, fields: Mapping[str, str | int | float | bytes], ttl_s: float, *,
                   advertise: bool) -> None:
        """One heartbeat in one round trip: ``worker``'s hash set to ``fields``, expiring after
        ``ttl_s`` (+1 s); with ``advertise`` the worker in the model's ready set and the model in
        the set of models, each scored by that expiry, else the worker out of the ready set; then
        the ready set's expired members dropped."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.worker(worker), mapping=dict(fields))
        pipe.expire(self.keys.worker(worker), int(ttl_s) + 1)
        if advertise:
            expiry = now_ms() + ttl_s * 1000
            pipe.zadd(self.keys.workers(model), {worker: expiry})
            pipe.zadd(self.keys.models(), {model: expiry}, gt=True)  # how APIs discover models
        else:
            pipe.zrem(self.keys.workers(model), worker)
        pipe.zremrangebyscore(self.keys.workers(model), 0, now_ms())
        await pipe.execute()

    async def deregister(self, model: str, worker: str) -> None:
        """Remove ``worker``'s hash and its place in the model's ready set."""
        await self.redis.delete(self.keys.worker(worker))
        await self.redis.zrem(self.keys.workers(model), worker)

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

    async def take_over(self, model: str, dead: str, consumer: str, count: int, *,
                        max_deliveries: int = 3) -> list[Delivery]:
        """Move up to ``count`` entries that consumer ``dead`` holds to ``consumer``, the most
        urgent level first, and claim them (takeover.lua: atomic per level, so two takers never
        share an entry; the claim bumps each job's attempt, the fence). A level where ``dead`` is
        left holding nothing loses the consumer too."""
        taken: list[tuple[int, bytes, str]] = []
        for level, queue in enumerate(self.keys.queues(model)):
            rows = await self._takeover(keys=[queue], args=[dead, consumer, count - len(taken)])
            taken += [(level, entry_id, job.decode()) for entry_id, job in rows]
        return await self._claim(model, consumer, taken, max_deliveries, reclaimed=True)

    async def _claim(self, model: str, consumer: str, entries: list[tuple[int, bytes, str]], max_deliveries: int,
                     *, reclaimed: bool) -> list[Delivery]:
        if not entries:
            return []
        keys: list[str] = []
        for _, _, job_id in entries:
            keys += [self.keys.job(model, job_id), self.keys.events(model, job_id)]
        states = await self._start(keys=keys, args=[consumer, now_ms(), max_deliveries])
        return self._deliveries(entries, states, reclaimed=reclaimed)

    def _deliveries(self, entries: list[tuple[int, bytes, str]], states: list, *, reclaimed: bool) -> list[Delivery]:
        """Deliveries from entries (level, entry id, job id) and their claim rows (claim.lua)."""
        deliveries = []
        for (level, entry_id, job_id), row in zip(entries, states, strict=True):
            state, request, queued_at, attempt, last_seq, prompt_ids, deadline, trace, lost, lost_started, tenant = row
            state = state.decode()
            decoded = None
            if state in ("run", "cancelled", "dead", "expired"):
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
                level=level,
                deadline=float(deadline) if deadline else None,
                traceparent=trace.decode() if trace else "",
                lost_worker=lost.decode() if lost else "",
                lost_started=float(lost_started) if lost_started else 0.0,
                tenant=tenant.decode() if tenant else "",
            ))
        return deliveries

    async def ack(self, model: str, entry_id: bytes, level: int = 0) -> None:
        """Ack and delete one delivered entry that needs no answer (its job is gone or finished)."""
        # One script rather than MULTI: as atomic, and redis-py's Cluster pipeline has no MULTI.
        await self._ack(keys=[self.keys.queue(model, level)], args=[entry_id])

    async def renew(self, model: str, worker: str, held: list[Held], *, hand_back_idle_ms: int | None = None
                    ) -> list[str]:
        """Renew the leases of ``held`` (reset their idle time; fenced). With ``hand_back_idle_ms``
        instead hand them back: idle set past the lease, so a peer's next reclaim takes them at
        once. Returns the job ids this worker no longer owns."""
        if not held:
            return []
        args: list[str | bytes | int] = [worker, hand_back_idle_ms or 0, 1 if hand_back_idle_ms else 0]
        keys: list[str] = []
        for h in held:
            args += [h.entry_id, h.attempt]
            keys += [self.keys.job(model, h.job_id), self.keys.queue(model, h.level)]
        lost = await self._renew(keys=keys, args=args)
        return [held[int(i)].job_id for i in lost]

    async def flush(self, model: str, batch: list[Outbound], worker: str = "") -> list[str]:
        """Publish a batch of events in ONE round trip (flush.lua): per event XADD to the event
        log, and one PUBLISH per following API process's relay channel (or per event to the job's
        own live channel when none is recorded); per terminal event also the record update, the
        compact log and XACK + XDEL. Each event is written only while ``worker`` still owns its
        job at the event's attempt. Returns the ids of jobs whose events were refused: the worker
        lost them.

        One script is atomic, and legal on Cluster: every key of one model shares its hash tag.
        """
        keys = [self.keys.dead(model), self.keys.webhooks(model), *self.keys.queues(model), *self._metering(model)]
        args: list[str | bytes | int | float] = [worker, self.result_ttl_s, now_ms(), self.keys.live(model, ""),
                                                 LEVELS, self.keys.tenant(model, ""), self.usage_ttl_s]
        job_key, log_key = self.keys.job, self.keys.events
        for out in batch:
            keys += [job_key(model, out.job_id), log_key(model, out.job_id)]
            args += [out.attempt, out.event.seq, encode(out.event), out.job_id]
            if out.first_token_at is None and out.prompt_ids is None and isinstance(out.event, Tokens):
                args.append(0)  # the usual token event: nothing beyond the log and the live path
            else:
                args += self._more(out)
        await self._publishing()
        lost = await self._flush(keys=keys, args=args)
        return sorted({batch[int(i)].job_id for i in lost})

    @classmethod
    def _more(cls, out: Outbound) -> list[str | bytes | int | float]:
        """What an event writes beyond the log and the live path: flush.lua's count, then the values."""
        status, field, payload = cls._terminal(out)
        # The tokens its tenant is charged: the result's usage, else what the worker counted (-1: unknown).
        usage = out.result.usage if out.result is not None else out.usage
        return [11, "" if out.first_token_at is None else out.first_token_at,
                encode(out.prompt_ids) if out.prompt_ids is not None else "",
                status, field, payload, out.entry_id or "", out.level, "1" if out.dead else "", out.log or "",
                usage.prompt_tokens if usage else -1, usage.completion_tokens if usage else -1]

    @staticmethod
    def _terminal(out: Outbound) -> tuple[str, str, bytes | str]:
        match out.event:
            case Done():
                return "done", "result", encode(out.result or JobResult())
            case Error(code=code, message=message, status=status) as error:
                outcome = "cancelled" if isinstance(error.exception(), JobCancelled) else "failed"
                return outcome, "error", encode(JobError(code=code, message=message, status=status))
            case Tokens():
                return "", "", ""
