"""A worker's face of the queue: the consumer. It picks, reads and claims jobs (the most urgent
level first, by fair share between tenants), waits for work, renews and hands back leases, takes
over the jobs of dead or stalled peers, and writes its jobs' events through the fenced writer
(shared/queue/writer.py).

A claim bumps the job's attempt; the attempt is the fence every later write of the job passes, so
a worker that lost a job can write nothing more about it. A worker's presence (heartbeat, control
channel, peers) is shared/registry.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar, get_args

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import scripts
from shared.codec import decode_request
from shared.durability import NOT_DURABLE, Durability
from shared.keys import GROUP, Keys
from shared.queue.base import Side
from shared.queue.writer import Flushed, Outbound, now_ms
from shared.schemas import GenerationRequest

__all__ = ["Consumer", "Delivery", "DeliveryState", "Held", "Picked", "Swap"]

log = structlog.get_logger()
T = TypeVar("T")

# XAUTOCLAIM calls per level per reclaim (a worker reclaims at most once a second).
RECLAIM_CALLS_PER_LEVEL = 3

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


DeliveryState = Literal["run", "cancelled", "dead", "expired", "late", "missing", "finished", "invalid"]
"""What a worker does with a delivered entry, as claim.lua decided (``invalid``: the record's
request does not decode here):

- ``run``: start it (the claim took ownership: attempt + 1, worker = us);
- ``cancelled``, ``expired`` (its deadline passed), ``late`` (its first-token deadline passed
  before it ever started), ``dead`` (out of deliveries), ``invalid``: owned too, and ended at once
  with that error, never reaching the engine;
- ``missing`` (no record: expired or never written), ``finished`` (the entry outlived its job):
  nothing to own; the entry is only cleared."""
_STATES: frozenset[str] = frozenset(get_args(DeliveryState))
# The states whose row holds the request.
_OWNED: frozenset[str] = frozenset({"run", "cancelled", "dead", "expired", "late"})


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
    predicted_ttft: float | None = None
    """Its time to first token (ms) as admission predicted it (enqueue.lua; None: not predicted)."""

    @property
    def held(self) -> Held:
        """What the worker holding it renews and hands back."""
        return Held(self.job_id, self.entry_id, self.attempt, self.level)


@dataclass(slots=True)
class Held:
    """A job a worker holds: what its lease renewal and hand-back need."""

    job_id: str
    entry_id: bytes
    attempt: int
    level: int = 0


class Picked(NamedTuple):
    """What one pick (:meth:`Consumer.pick`) gave a worker."""

    deliveries: list[Delivery]
    """The jobs picked, read and claimed (none: nobody waits)."""
    tops: list[bytes]
    """When nothing was picked, each level's newest waiting entry then: where
    :meth:`Consumer.wait_for_work` waits from, so a job queued since wakes it at once."""
    acked: int | None = None
    """A pick with ``confirm=False``: the claims are made, not yet confirmed (their token shards
    not fenced, under LLMQ_DURABILITY not yet on the replicas). The caller must
    :meth:`Consumer.confirm` them, passing this (the replicas' confirmations so far), before it writes
    anything about the jobs. None: confirmed, or nothing picked."""
    wake_ms: int = 0
    """With affinity: ms until a job this pick left for another worker becomes anyone's, the
    longest :meth:`Consumer.wait_for_work` may block (no new entry will wake it for that job); 0: none."""


class Swap(NamedTuple):
    """What one preemption check (:meth:`Consumer.preempt`) gave a worker with no free slot."""

    victim: str | None
    """The running job that gives way (handed back: it waits again); None: none does."""
    deliveries: list[Delivery]
    """The job picked into its slot, claimed but not confirmed (as :meth:`Consumer.pick` with
    ``confirm=False``: :meth:`Consumer.confirm` it, passing ``acked``, before writing about it)."""
    acked: int
    waiting: bool
    """A job waits (none gave way for it now): the worker asks again soon."""
    tops: list[bytes]
    """Nothing waits: each level's newest waiting entry (:attr:`Picked.tops`)."""


class Consumer(Side):
    """A worker's consumer on ``redis``: what it reads, claims, renews and writes of its jobs."""

    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, usage_days: int = 400,
                 durability: Durability = NOT_DURABLE):
        super().__init__(redis, keys, result_ttl_s=result_ttl_s, usage_days=usage_days, durability=durability)
        self._reclaim_from: dict[str, bytes | str] = {}  # per level queue: where the next scan resumes

    async def ensure_group(self, model: str) -> None:
        """Create every level's consumer group from the stream's start ('0'), so jobs queued
        before any worker existed are still delivered."""
        for queue in self.keys.queues(model):
            try:
                await self.redis.xgroup_create(queue, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def pick(self, model: str, consumer: str, count: int, max_deliveries: int = 3, *,
                   confirm: bool = True, affinity: scripts.Affinity = scripts.NO_AFFINITY,
                   lead_ms: float = 0) -> Picked:
        """Pick, read and claim up to ``count`` new jobs, the most urgent level first, by fair
        share between tenants within a level: read.lua, one round trip, never blocking. Ask only
        for as many as can start now (the engine's free slots): nothing is claimed that could not.
        Then the claims are confirmed (:meth:`confirm`: their token shards fenced, and under
        LLMQ_DURABILITY held until the replicas have them); ``confirm=False`` leaves that to the
        caller (:attr:`Picked.acked`), which may start the engine meanwhile but must write nothing
        until then. ``affinity``: leave jobs a moment for the workers that hold their keys
        (read.lua). ``lead_ms``: the worker's mean time from a start to a first token; a job whose
        first-token deadline passes within it is not started (claim.lua, ``late``)."""
        call = scripts.read(self.keys, model, consumer, count, now=now_ms(), max_failed=max_deliveries,
                            affinity=affinity, lead_ms=lead_ms)
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
                      max_failed: int, max_preemptions: int, lead_ms: float = 0) -> Swap:
        """Whether one of ``candidates`` (running jobs of ``consumer``, whose engine has no free
        slot) gives way to a waiting job, and if so the swap, in one round trip (preempt.lua): the
        candidate handed back to wait again, the waiting job picked and claimed in its place."""
        call = scripts.preempt(self.keys, model, consumer, candidates, now=now_ms(), max_failed=max_failed,
                               max_preemptions=max_preemptions, lead_ms=lead_ms)
        (victim, rows, waiting, tops), acked = await self._run(call)
        deliveries = self._deliveries([(int(level), entry_id, job.decode()) for level, entry_id, job, _ in rows],
                                      [state for *_, state in rows], reclaimed=False)
        return Swap(candidates[victim].job_id if victim >= 0 else None, deliveries, acked, bool(waiting), tops)

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

    async def _take(self, model: str, worker: str, deliveries: list[Delivery]) -> list[Delivery]:
        """Fence the token shards of jobs just claimed at their new attempt (take.lua), and learn
        where each log ends (:attr:`Delivery.last_seq`). A job whose shard a later attempt holds
        is dropped (a peer claimed it meanwhile); one whose terminal event is logged and whose
        record was not ended (its writer died between the two) is ended now, from its ending, and
        handed on as ``finished``."""
        owned = [d for d in deliveries if d.state not in ("missing", "finished")]
        if not owned:
            return deliveries
        fences = await self.writer.take(model, worker, [(d.job_id, d.attempt, d.relay) for d in owned])
        lost: set[str] = set()
        ended: list[tuple[str, int, scripts.Extra]] = []
        for d, fence in zip(owned, fences, strict=True):
            d.last_seq = fence.last_seq
            if fence.state == b"lost":
                lost.add(d.job_id)
            elif fence.ending is not None:  # ended
                ended.append((d.job_id, d.attempt, fence.ending._replace(entry=d.entry_id, entry_level=d.level)))
                d.state = "finished"
        if ended:
            log.warning("job_end_recovered", jobs=[job_id for job_id, _, _ in ended])
            await self.writer.finish(model, ended, [(job_id, False) for job_id, _, _ in ended])
        return [d for d in deliveries if d.job_id not in lost]

    def _deliveries(self, entries: list[tuple[int, bytes, str]], states: list, *, reclaimed: bool) -> list[Delivery]:
        """Deliveries from entries (level, entry id, job id) and their claim rows (claim.lua)."""
        deliveries = []
        for (level, entry_id, job_id), row in zip(entries, states, strict=True):
            (raw, request, queued_at, attempt, deadline, trace, lost, lost_started, tenant, relay, preemptions,
             predicted) = row
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
                predicted_ttft=float(predicted) if predicted else None,
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
            await self.writer.release(model, worker, [(h.job_id, h.attempt) for h in held if h.job_id not in gone])
        return gone

    def _renewal(self, model: str, worker: str, held: list[Held], hand_back_idle_ms: int | None = None
                 ) -> scripts.Call:
        return scripts.renew(self.keys, model, worker, [(h.job_id, h.entry_id, h.attempt, h.level) for h in held],
                             idle_ms=hand_back_idle_ms or 0, hand_back=bool(hand_back_idle_ms))

    async def flush(self, model: str, batch: list[Outbound], worker: str = "") -> Flushed:
        """Write a batch of the worker's events, fenced: :meth:`EventWriter.flush`."""
        return await self.writer.flush(model, batch, worker)
