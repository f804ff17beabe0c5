"""The consumer loop of one worker: read jobs sized to free engine slots, run them, publish.

Tasks (all owned by :meth:`Worker.run`):

- reader: first takes over jobs whose lease lapsed (``XAUTOCLAIM``: their worker died or
  stalled; they continue from their published tokens, workers/continuation.py), then picks new
  jobs, the most urgent priority level first (``Consumer.pick``), and when nobody waits blocks until
  a job is queued (``Consumer.wait_for_work``, holding no slot); never claims more jobs than the
  engine can start (workers/slots.py), so nothing waits unseen inside this process. With no
  slot free it offers the running jobs that may give way (workers/preemption.py decides which)
  to a waiting job owed a slot, and swaps one for it.
- watcher: takes over at once the jobs of a peer whose process died, told by its control
  subscription being gone (:meth:`Presence.dead_peers`, workers/presence.py); the lease stays
  the backstop for a peer that is alive but stalled, hung or cut off.
- one task per job, in the same task group: iterates the engine's DELTA outputs, turned into
  events by its :class:`workers.attempt.Attempt`, and hands them to the outbox; a timer aborts
  it at the job's deadline.
- flusher (:meth:`workers.outbox.Outbox.run`): writes the outbox in one round trip per batch
  (events of one engine step together); while it writes, a job's next steps join the job's event
  still in the outbox, where the job's dialect renders text deltas (shared/chunking.py).
- heartbeat and control: the worker's key with a TTL (:class:`Presence`, which the worker owns),
  the leases of its jobs (renewed, fenced by owner and attempt: a job reclaimed by a peer is
  aborted here and written nowhere), and aborts.
- recovery, after an engine death: the worker keeps its slots, heartbeat and leases, rebuilds its
  engine in place and continues the jobs that were in it (its *suspects*) one at a time, reading
  nothing new until they are done; a job that kills the engine while it runs alone is
  dead-lettered (``EngineFault``). Past LLMQ_ENGINE_RESTARTS deaths in the window it exits
  instead, and peers continue its jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, assert_never

import msgspec
import structlog
from redis.exceptions import ResponseError

from shared.chunking import merges_steps
from shared.config import Settings
from shared.errors import (
    DeadLetter,
    DeadlineExceeded,
    EngineDead,
    EngineFault,
    GenerationFailed,
    InvalidRequest,
    JobCancelled,
    JobMissing,
    LeaseLost,
    Preempted,
    ServiceError,
)
from shared.events import Done, Error, Timings
from shared.media import HOLD_MARGIN_S, TEXT_ONLY, MediaStore, ModelInfo
from shared.metrics import Recorder
from shared.queue import Consumer, Delivery, Held, Swap, now_ms
from shared.redis import REDIS_DOWN
from shared.registry import Registry
from shared.schemas import GenerationRequest, JobResult, Pooling, Usage
from shared.scripts import NO_AFFINITY, Affinity, Candidate
from workers import preemption
from workers.attempt import Attempt, Emission
from workers.continuation import plan_for
from workers.media import load_images
from workers.outbox import Outbox
from workers.presence import Presence, Status
from workers.protocol import Death, Engine, Step
from workers.rates import RateMeter
from workers.slots import Reservation, Slots

if TYPE_CHECKING:  # OpenTelemetry is imported only with tracing on
    from shared.tracing import Tracing
    from workers.tracing import JobSpans

__all__ = ["Worker"]

log = structlog.get_logger()


_info_json = msgspec.json.Encoder().encode


# What a worker serves before it reports ready, by its model's kind (a pooling engine generates nothing).
_WARM_UP = {"generate": GenerationRequest(prompt="warm up", dialect="jobs"),
            "embed": GenerationRequest(pooling=Pooling(task="embed", texts=["warm up"])),
            "rerank": GenerationRequest(pooling=Pooling(task="score", texts=["up"], queries=["warm"]))}


def _hold(deadline: float | None) -> float | None:
    """How long a job's images are kept from its claim: to its ``deadline`` (epoch ms) and a
    margin past it (None: no deadline, the store's TTL)."""
    return None if deadline is None else max(deadline - now_ms(), 0) / 1000 + HOLD_MARGIN_S


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    """Cancel ``tasks`` and return once they are done. Cancelled again until they are: on Python
    3.11, redis-py sends every command through ``asyncio.wait_for``, which drops a cancel that
    arrives just as the send completes, and the task's loop would then run on (seen in CI: a
    worker that never finished stopping)."""
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)


@dataclass(slots=True)
class _Running:
    task: asyncio.Task[None]
    held: Held
    stop_reason: ServiceError | None = None  # why we cancelled it, if we did
    deadline: asyncio.TimerHandle | None = None  # aborts the job when its deadline passes
    spans: JobSpans | None = None  # with tracing on
    claim: asyncio.Event | None = None
    """Set once its claim is on the replicas LLMQ_DURABILITY wants (None: it was when the job
    started). The engine runs meanwhile; nothing about the job is written before it is set."""
    tenant: str = ""
    preemptible: bool = False
    """It may give way to a waiting job (:func:`workers.preemption.may_give_way`)."""
    preemptions: int = 0
    started: float = 0.0  # the event loop's time at its start
    attempt: Attempt | None = None  # once its task runs
    slot_passed: bool = False  # preempted: its slot went to the job that took its place, not back
    in_engine: bool = False
    """It reached a live engine: only then can its engine's death be its doing."""


@dataclass(slots=True)
class _Suspect:
    """A job that was in the engine when it died: continued after the rebuild, alone."""

    delivery: Delivery
    attempt: Attempt
    """The attempt that was running: its events are logged up to ``attempt.seq``."""
    stop_reason: ServiceError | None = None  # a cancel or a lost lease meanwhile


class Worker:
    def __init__(self, settings: Settings, queue: Consumer, engine: Engine, *, worker_id: str | None = None,
                 device: str = "", devices: Sequence[str] = (), tracing: Tracing | None = None,
                 info: ModelInfo = TEXT_ONLY, freeze_heap: bool = False):
        self.settings = settings
        self._freeze_heap = freeze_heap  # LLMQ_GC_FREEZE, set by the process that owns the heap
        self.info = info  # what its model takes: told to the APIs as it comes up (shared/media.py)
        self.media = MediaStore(queue.redis, queue.keys, settings.media_ttl_s)  # its jobs' images
        self.tracing = tracing  # None: tracing off, and no span work anywhere below
        self.queue = queue
        self.engine = engine
        self.model = settings.model_name
        self.slots = Slots(settings.max_num_seqs)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self.ready = False
        self.failed = False  # it gave up on its engine: the process should exit non-zero
        self._running: dict[str, _Running] = {}
        self._engine_up = asyncio.Event()
        """Set while the engine serves: cleared at its death until it is rebuilt and its suspects
        are done (:meth:`_recover`); nothing new is read meanwhile."""
        self._suspects: dict[str, _Suspect] = {}  # the dead engine's jobs, in the order they told
        self._alive_at_death: set[str] = set()  # the jobs running when the engine's death was first seen
        self._alone: str | None = None  # the suspect running alone in the rebuilt engine
        self._deaths: list[float] = []  # the loop's time of each engine death in the window
        self._recovery: asyncio.Task[None] | None = None
        self._tasks: asyncio.TaskGroup | None = None  # the run's: job tasks start in it
        self.outbox = Outbox(queue, self.model, self.worker_id, self._lose)
        self._stopping = asyncio.Event()
        self._lease_ms = int(settings.lease_s * 1000)
        self._next_reclaim = 0.0
        self.metrics = Recorder(self.model)  # pushed with each heartbeat (shared/metrics.py)
        self.rates = RateMeter()  # its measured speed, in each heartbeat (workers/rates.py)
        self.presence = Presence(settings, Registry(queue.redis, queue.keys), self.worker_id, self.metrics,
                                 device=device, devices=devices, rates=self.rates.rates)

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Begin a graceful drain (SIGTERM): stop reading, let in-flight jobs finish."""
        self._stopping.set()

    async def warm_up(self) -> None:
        """Serve one request before reporting ready: the first request on CPU pays ~20 s of
        one-off compilation that no user should wait for."""
        await self.engine.run(f"warmup-{self.worker_id}", _WARM_UP[self.info.kind], on_step=lambda step: None)
        if self._freeze_heap:  # what the worker holds from now on is never scanned again (LLMQ_GC_FREEZE)
            gc.collect()
            gc.freeze()
        self.ready = True

    async def run(self) -> None:
        """Warm up, serve until :meth:`stop`, drain, and leave nothing behind in Redis."""
        await self.queue.ensure_group(self.model)
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg
            heartbeat = tg.create_task(self._heartbeat())
            control = tg.create_task(self.presence.control(self._cancel_requested))
            await self.warm_up()
            self._engine_up.set()
            await self.presence.registry.describe(self.model, _info_json(self.info))
            await self._beat()
            log.info("worker_ready", worker=self.worker_id, slots=self.slots.total)
            flusher = tg.create_task(self.outbox.run())
            watcher = tg.create_task(self._watch())
            await self._reader()
            await self._drain()
            await _cancel(heartbeat, control, watcher, *([self._recovery] if self._recovery else []))
            self.outbox.close()  # the flusher writes what is left, then returns
            await flusher
        self._tasks = None
        await self.presence.unregister()

    # --- reading ------------------------------------------------------------------------------

    async def _reader(self) -> None:
        delay = 0.1
        while not self._stopping.is_set():
            if not self._engine_up.is_set():  # rebuilding, or continuing its suspects: nothing new
                await self._until(self._engine_up)
                continue
            if self.slots.available <= 0 and not self.settings.preempt:
                await self.slots.wait_free(self._stopping)
                continue
            if not self.presence.control_up.is_set():
                # Without our control subscription peers would take our jobs for a dead worker's:
                # read nothing until it is (back) up.
                await self._until(self.presence.control_up)
                continue
            try:
                if self.slots.available <= 0:
                    await self._full()
                    delay = 0.1
                    continue
                await self._reclaim()
                waiting = await self._pick()
                # Nobody waits: block, holding no slot (a takeover meanwhile may need them all),
                # until a job is queued after the newest waiting entry the pick saw, or a job it
                # left for another worker becomes anyone's; then pick at once, with the room left.
                if waiting is not None:
                    tops, wake_ms = waiting
                    block_ms = min(self.settings.block_ms, wake_ms) if wake_ms else self.settings.block_ms
                    woken = await self.queue.wait_for_work(self.model, tops, block_ms, self._stopping)
                    if (woken or wake_ms) and self._engine_up.is_set():  # it may have died meanwhile
                        await self._pick()
                delay = 0.1
            except REDIS_DOWN as exc:
                log.warning("redis_read_failed", retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _until(self, event: asyncio.Event) -> None:
        """Return once ``event`` is set, or within half a second, to check for a stop again."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await event.wait()

    async def _pick(self) -> tuple[list[bytes], int] | None:
        """Pick as many new jobs as there are slots available and start them. Returns, when
        nobody waits, where to wait for work from and for how long at most
        (:attr:`shared.queue.Picked.tops`, :attr:`~shared.queue.Picked.wake_ms`); else None."""
        await self.outbox.write_ends()
        with self.slots.reserve(self.slots.available) as slots:
            if not slots.held:
                return None
            picked = await self.queue.pick(self.model, self.worker_id, slots.held, self.settings.max_deliveries,
                                           confirm=False, affinity=self._affinity(), lead_ms=self._lead_ms())
            if picked.acked is not None:
                await self._start_confirming(picked.deliveries, picked.acked, slots)
        return None if picked.deliveries else (picked.tops, picked.wake_ms)

    # --- preemption ---------------------------------------------------------------------------

    async def _full(self) -> None:
        """No free slot: wait for one. Meanwhile offer the running jobs that may give way
        (:meth:`_candidates`) to a waiting job owed a slot (preempt.lua, docs/tenants.md#preemption),
        and swap one for it; asked again every PREEMPT_POLL_S while jobs wait, and, when nobody
        waits, once a job is queued."""
        candidates, soonest = self._candidates()
        if candidates:
            await self.outbox.write_ends()
            swap = await self.queue.preempt(self.model, self.worker_id, candidates,
                                            max_failed=self.settings.max_deliveries,
                                            max_preemptions=self.settings.preempt_max,
                                            lead_ms=self._lead_ms())
            if swap.victim is not None:
                await self._swap(swap)
                return
            if not swap.waiting:  # a slot that frees meanwhile has nobody to run: no hurry
                await self.queue.wait_for_work(self.model, swap.tops, self.settings.block_ms, self._stopping)
                return
            soonest = preemption.PREEMPT_POLL_S
        elif soonest is None:  # none of ours may give way, now or later
            await self.slots.wait_free(self._stopping)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(soonest):
                await self.slots.wait_free(self._stopping)

    def _candidates(self) -> tuple[list[Candidate], float | None]:
        """The running jobs that may give way now, and the seconds until another may
        (:func:`workers.preemption.candidates`)."""
        running = [preemption.RunningJob(job_id, r.held, r.tenant, r.started, r.preemptions,
                                         confirmed=r.claim is None or r.claim.is_set(), attempt=r.attempt)
                   for job_id, r in self._running.items() if r.preemptible and r.stop_reason is None]
        return preemption.candidates(running, asyncio.get_running_loop().time(), self.settings)

    async def _swap(self, swap: Swap) -> None:
        """A running job gave way (preempt.lua handed it back to wait again): stop it here, writing
        nothing more (whoever picks it next continues it from its published tokens), and start the
        job picked in its place, in its slot."""
        assert swap.victim is not None
        running = self._running.get(swap.victim)
        self.metrics.inc("llmq_worker_preemptions_total")
        log.info("job_preempted", job_id=swap.victim, by=[d.job_id for d in swap.deliveries])
        if running is None:  # it ended meanwhile, and freed its slot
            handover = self.slots.reserve(1)
        else:
            handover = self.slots.pass_on()
            running.slot_passed = True
            self.cancel_job(swap.victim, Preempted("its slot went to a job owed it"))
        with handover as slots:
            if slots.held:
                await self._start_confirming(swap.deliveries, swap.acked, slots)
                return
        # Its slot went to a dead peer's job meanwhile: the picked job goes back for a peer.
        held = [d.held for d in swap.deliveries]
        await self.queue.renew(self.model, self.worker_id, held, hand_back_idle_ms=self._lease_ms + 60_000)

    def _lead_ms(self) -> float:
        """How near its first-token deadline a job may be picked and still make it: this worker's
        time from a start to a first token (its measured mean, two deviations up: most jobs make
        it within that) plus LLMQ_SLO_MARGIN_MS for the token's way out. A job nearer than that is
        not started (claim.lua, ``late``)."""
        return self.rates.lead_ms() + self.settings.slo_margin_ms

    def _affinity(self) -> Affinity:
        """What this worker's pick says of affinity: the settings, and the adapters its engine holds."""
        if not self.settings.affinity_ms:
            return NO_AFFINITY
        return Affinity(self.settings.affinity_ms, int(self.settings.affinity_hold_s * 1000),
                        self.engine.adapter_state().held)

    async def _start_confirming(self, deliveries: list[Delivery], acked: int, slots: Reservation) -> None:
        """Jobs just picked, their claims not yet confirmed (:meth:`shared.queue.Consumer.confirm`:
        their token shards fenced, under LLMQ_DURABILITY their claims on the replicas). A fresh
        job (its first attempt: nothing logged, nobody else's) starts in the engine at once, its
        prompt processed meanwhile and its events held until the confirmation; one whose claim is
        lost meanwhile is aborted, having written nothing. The rest start or end once confirmed:
        a continuation needs to know where its log ends (:attr:`Delivery.last_seq`)."""
        claim = asyncio.Event()
        early = [d for d in deliveries if d.state == "run" and d.attempt == 1]
        for delivery in early:
            await self._accept(delivery, slots, claim)
        confirmed: list[Delivery] = []
        try:
            confirmed = await self.queue.confirm(self.model, self.worker_id, deliveries, acked)
        finally:  # Redis gone meanwhile: none is confirmed, and each lease lapses to a peer
            kept = {d.job_id for d in confirmed}
            for delivery in early:
                if delivery.job_id not in kept:
                    self.cancel_job(delivery.job_id, LeaseLost("its claim was not confirmed"))
            claim.set()
        started = {d.job_id for d in early}
        for delivery in confirmed:
            if delivery.job_id not in started:
                await self._accept(delivery, slots)

    async def _reclaim(self) -> None:
        """Take over jobs whose lease lapsed, before any new work (they have waited longest).
        Checked at most every quarter lease."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_reclaim:
            return
        self._next_reclaim = loop.time() + min(self.settings.lease_s / 4, 1.0)
        with self.slots.reserve(self.slots.available) as slots:
            if not slots.held:
                return
            deliveries = await self.queue.reclaim(self.model, self.worker_id, slots.held, self._lease_ms,
                                                  max_deliveries=self.settings.max_deliveries,
                                                  exclude=frozenset(self._running))
            for delivery in deliveries:
                log.info("job_reclaimed", job_id=delivery.job_id, attempt=delivery.attempt, state=delivery.state,
                         after_seq=delivery.last_seq)
            await self._adopt(deliveries, slots)

    async def _adopt(self, deliveries: list[Delivery], slots: Reservation) -> None:
        """Run jobs taken from another consumer (a lapsed lease, a dead peer): like new ones, but
        continued from their published tokens (plan_for) and counted as reclaimed."""
        self.metrics.inc("llmq_worker_jobs_reclaimed_total", len(deliveries))
        for delivery in deliveries:
            await self._accept(delivery, slots)

    # --- taking over from dead peers ----------------------------------------------------------

    async def _watch(self) -> None:
        """Take over the jobs of peers whose control subscription is gone (their process died),
        within LLMQ_TAKEOVER_S plus one poll rather than a whole lease.

        Every fifth of LLMQ_TAKEOVER_S: one round trip for the consumers holding entries; only if
        another one does, one PUBSUB NUMSUB for their control channels and ours. A peer seen with
        no subscriber at every poll for LLMQ_TAKEOVER_S counts as dead. Longer than a reconnect,
        so a dropped connection (re-subscribed at once) hands nothing away; a stalled process
        keeps its sockets, so a stall never does. Polled while this worker is full too, so a
        slot that frees finds the judgement made."""
        if self.settings.takeover_s <= 0:
            return
        loop = asyncio.get_running_loop()
        absent: dict[str, float] = {}  # peer -> when it was first seen without a subscriber
        while True:
            await asyncio.sleep(self.settings.takeover_s / 5)
            if self._stopping.is_set() or not self.presence.control_up.is_set() or not self._engine_up.is_set():
                absent.clear()  # no use for more jobs, or no right to judge: afresh once there is
                continue
            try:
                for dead in await self.presence.dead_peers(absent, loop.time):
                    await self._take_over(dead)  # as many as there is room for; the rest next poll
            except (*REDIS_DOWN, ResponseError) as exc:  # Redis away, or its group gone (a restart)
                log.debug("watch_failed", error=str(exc))
                absent.clear()

    async def _take_over(self, dead: str) -> None:
        with self.slots.reserve(self.slots.available) as slots:
            if not slots.held:
                return
            deliveries = await self.queue.take_over(self.model, dead, self.worker_id, slots.held,
                                                    max_deliveries=self.settings.max_deliveries)
            if deliveries:
                log.info("worker_jobs_taken_over", dead_worker=dead, jobs=[d.job_id for d in deliveries],
                         attempts=[d.attempt for d in deliveries])
            await self._adopt(deliveries, slots)

    def _spans(self, d: Delivery) -> JobSpans | None:
        if self.tracing is None or d.state in ("missing", "finished"):
            return None
        from workers.tracing import JobSpans

        return JobSpans(self.tracing, d, self.model, self.worker_id)

    def _traced(self, job_id: str) -> dict[str, str]:
        """``trace_id`` for a log line about a running job, outside its task's bound context."""
        running = self._running.get(job_id)
        spans = running.spans if running is not None else None
        return {"trace_id": spans.trace_id} if spans is not None and spans.trace_id else {}

    async def _accept(self, d: Delivery, slots: Reservation, claim: asyncio.Event | None = None) -> None:
        """Start a claimed job, in a slot of ``slots``, or end it at once (by its state).
        ``claim``: set once the claim is confirmed (:attr:`_Running.claim`)."""
        spans = self._spans(d)
        if spans is not None and spans.trace_id:
            # Its log lines here and in its task (which copies this context) lead to its trace.
            with structlog.contextvars.bound_contextvars(trace_id=spans.trace_id):
                return await self._start(d, spans, slots, claim)
        return await self._start(d, spans, slots, claim)

    async def _start(self, d: Delivery, spans: JobSpans | None, slots: Reservation,
                     claim: asyncio.Event | None = None) -> None:
        match d.state:
            case "run":
                assert d.request is not None and self._tasks is not None
                self.metrics.inc("llmq_worker_jobs_started_total")
                if not d.reclaimed:
                    self.metrics.observe("llmq_queue_wait_seconds", (now_ms() - d.queued_at) / 1000)
                slots.fill()
                # In the run's task group: on a kill the group cancels it with the rest, and a
                # failure that escaped its own handlers (a bug) stops the worker, never vanishes.
                task = self._tasks.create_task(self._run_job(d, d.request, spans), name=f"job-{d.job_id}")
                task.add_done_callback(functools.partial(self._cancelled_unstarted, d))
                running = _Running(task=task, held=d.held, spans=spans,
                                   claim=claim, tenant=d.tenant, started=asyncio.get_running_loop().time(),
                                   preemptions=d.preemptions,
                                   preemptible=preemption.may_give_way(d, self.settings))
                if d.deadline is not None:
                    running.deadline = asyncio.get_running_loop().call_later(
                        max(0.0, (d.deadline - now_ms()) / 1000), self.cancel_job, d.job_id,
                        DeadlineExceeded("the request's deadline passed while it was running"))
                self._running[d.job_id] = running
            case "missing":
                # The record expired or was never written: nothing to answer; just clear the entry.
                log.warning("job_record_missing", job_id=d.job_id)
                self._emit(d, Error.of(JobMissing("job record not found"), seq=1), entry_id=d.entry_id, attempt=0)
            case "finished":  # the job already ended; only its entry was left behind
                await self.queue.ack(self.model, d.entry_id, d.level)
            case "cancelled":
                self._end_unstarted(d, JobCancelled("job was cancelled before it started"))
            case "expired":
                log.info("job_expired_in_queue", job_id=d.job_id, waited_ms=round(now_ms() - d.queued_at, 1))
                self._end_unstarted(d, DeadlineExceeded("the request's deadline passed while it was queued"))
            case "late":
                log.info("job_late_in_queue", job_id=d.job_id, waited_ms=round(now_ms() - d.queued_at, 1))
                self._end_unstarted(d, DeadlineExceeded("the request's first-token deadline (its TTFT SLO) passed "
                                                        "while it was queued"))
            case "invalid":
                self._end_unstarted(d, InvalidRequest("the queued request is not valid for this worker"))
            case "dead":
                log.warning("job_dead_lettered", job_id=d.job_id, attempt=d.attempt)
                exc = DeadLetter(f"the job was delivered {d.attempt - 1} times and no worker finished it "
                                 "(workers died or stalled while running it)")
                self._emit(d, Error.of(exc, d.last_seq + 1), entry_id=d.entry_id, dead=True)
            case _:
                assert_never(d.state)

    def _cancelled_unstarted(self, d: Delivery, task: asyncio.Task[None]) -> None:
        """A job task cancelled before its first step never runs :meth:`_run_job` at all, so none
        of its handlers end the job or free its slot: a cancel notice that arrives between the
        claim and the task's start (a client's DELETE just as its job is picked). End it here."""
        running = self._running.get(d.job_id)
        if not task.cancelled() or running is None or running.task is not task:
            return  # it ran: _run_job's own handlers ended it (or it stopped with the worker)
        self._release(d.job_id)
        reason = running.stop_reason
        if isinstance(reason, LeaseLost):
            reason = None  # a peer owns a lost lease's job: nothing to end here
        if reason is not None:
            self._end_unstarted(d, reason)
        if running.spans is not None:
            running.spans.ended(reason.code if reason is not None else "released", Usage())

    def _release(self, job_id: str) -> None:
        """The job no longer runs here: its slot is free, its deadline timer off."""
        running = self._running.pop(job_id, None)
        if running is not None:
            if running.deadline is not None:
                running.deadline.cancel()
            if not running.slot_passed:
                self.slots.free()

    # --- one job ------------------------------------------------------------------------------

    async def _run_job(self, d: Delivery, req: GenerationRequest, spans: JobSpans | None = None) -> None:
        attempt = self._running[d.job_id].attempt = self._attempt(d)
        # How the attempt ended, for its span: "released" unless a branch below says otherwise.
        outcome = "released"
        # (With tracing on, trace_id is bound too: this task copied _accept's context.)
        with structlog.contextvars.bound_contextvars(job_id=d.job_id, model=self.model, worker=self.worker_id,
                                                     attempt=d.attempt):
            try:
                self.rates.started()  # paired with stopped() below: the meter's busy clock
                await self._generate(d, req, attempt, spans)
                outcome = "done"
            except asyncio.CancelledError:
                reason = self._running[d.job_id].stop_reason
                if reason is None:
                    raise
                await self.engine.abort(d.job_id)
                if isinstance(reason, LeaseLost):
                    # A peer owns the job now (or will, after a hand-back or a preemption): write
                    # nothing about it.
                    if isinstance(reason, Preempted):
                        outcome = reason.code
                    log.info("job_released", reason=reason.message)
                    return
                outcome = reason.code
                await self._claimed(d)
                self._end(d, attempt, reason)
            except EngineDead as exc:
                # Not the job's end: it keeps its lease and continues once the engine is rebuilt
                # (_recover), unless it was alone in an engine that died under it.
                outcome = exc.code
                await self._claimed(d)
                self._engine_died(d, attempt)
            except ServiceError as exc:
                outcome = exc.code
                await self._claimed(d)
                self._end(d, attempt, exc)
            except Exception as exc:  # an engine failure ends this job, not the worker
                log.exception("job_failed", may_quote_request=True)  # an engine error may quote the prompt
                error = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
                outcome = error.code
                await self._claimed(d)
                self._end(d, attempt, error)
            finally:
                if spans is not None:
                    spans.ended(outcome, attempt.usage, attempt.result)
                self.rates.stopped()
                self._release(d.job_id)

    async def _claimed(self, d: Delivery) -> None:
        """Return once the job's claim is confirmed (at once unless the job started before its
        confirmation: see :meth:`_start_confirming`); a claim lost meanwhile cancels the job
        here, which then writes nothing."""
        running = self._running.get(d.job_id)
        if running is not None and running.claim is not None:
            await running.claim.wait()
            running.claim = None

    @staticmethod
    def _attempt(d: Delivery) -> Attempt:
        """A new attempt at ``d``'s job. Its end compacts the log only when it writes every
        event of the job: a fresh start (no event logged yet), fenced (a known record)."""
        return Attempt(queued_at=d.queued_at, started_at=now_ms(), seq=d.last_seq,
                       whole_log=not d.last_seq and d.attempt > 0)

    async def _generate(self, d: Delivery, req: GenerationRequest, attempt: Attempt, spans: JobSpans | None) -> None:
        """Run the job in the engine (continued after what earlier attempts published), each step's
        event to the outbox, until its Done."""
        plan = await plan_for(self.queue, self.model, d, req, self.engine.parses(req))
        attempt.continues(plan.seq, plan.builder, prompt_tokens=plan.prompt_tokens, emitted=plan.emitted)
        headers = spans.engine_started() if spans is not None else None
        if not self.settings.engine_tracing:
            headers = None  # vLLM traces nothing: it would only warn of the headers
        running = self._running[d.job_id]
        claim = running.claim
        if self.engine.dead():  # it died before this job reached it: not this job's doing
            raise EngineDead("the engine was dead when the job started")
        # Read by hash as the job starts (and as a continuation starts), renewed until its deadline.
        images = await load_images(self.media, req, hold_s=_hold(d.deadline)) if req.images else None
        running.in_engine = True
        steps = _JobSteps(self, d, attempt, merges=merges_steps(req), claim=claim)
        await self.engine.run(d.job_id, plan.request, plan.parts, trace_headers=headers, images=images,
                              on_step=steps.take)
        if claim is not None:
            await self._claimed(d)
        steps.release()
        if not steps.ended:
            raise GenerationFailed("the engine ended the job without a final output")

    def _published(self, d: Delivery, attempt: Attempt, out: Emission, merges: bool) -> bool:
        """One step's emission counted, and its event to the outbox (the job's end: emitted with
        its result); returns whether it ended the job."""
        self.metrics.inc("llmq_worker_tokens_total", out.tokens)
        self.rates.generated(out.tokens)
        if out.first_token_at is not None:  # only a fresh attempt's: no earlier one published a token
            self.metrics.observe("llmq_ttft_seconds", (out.first_token_at - d.queued_at) / 1000)
            # Its whole prompt prefilled: the prefill rate's sample (a continuation's prefill
            # also covers the tokens it carries, and it never reports a first token).
            self.rates.first_token(attempt.usage.prompt_tokens,
                                   out.first_token_at - (attempt.timings.started_at or out.first_token_at))
            if d.predicted_ttft is not None:  # how far admission's prediction was off (docs/guarantees.md#slos)
                error = (out.first_token_at - d.queued_at - d.predicted_ttft) / 1000
                self.metrics.observe("llmq_ttft_predicted_seconds", d.predicted_ttft / 1000)
                self.metrics.observe("llmq_ttft_prediction_error_seconds", abs(error))
                self.metrics.inc("llmq_ttft_predictions_total", direction="late" if error > 0 else "early")
        if out.merged:
            return False  # its tokens joined the job's event still in the outbox (the flusher is behind)
        if out.terminal is not None:
            assert out.result is not None  # a step's terminal event is its Done, which carries the result
            if (pooled := out.result.pooled) is not None:
                self.metrics.inc("llmq_worker_pooled_inputs_total", pooled.count)
            self._emit(d, out.terminal, data=out.data, entry_id=d.entry_id, result=out.result,
                       first_token_at=out.first_token_at, log=out.log, history=attempt.encoded,
                       history_from=attempt.base, history_prompt_ids=attempt.logged_prompt_ids)
            self._log_finished(attempt.timings, attempt.usage, out.result)
            # Only a Done's tokens: a job cut short (cancelled, past its deadline) says little
            # of what a waiting job will ask for.
            self.rates.finished(attempt.usage.completion_tokens)
            return True
        self.outbox.add(d, attempt, out, joinable=merges)
        return False

    @staticmethod
    def _log_finished(timings: Timings, usage: Usage, result: JobResult) -> None:
        started = timings.started_at or timings.queued_at
        log.info("job_finished", queue_ms=round(started - timings.queued_at, 1),
                 ttft_ms=round((timings.first_token_at or started) - started, 1),
                 duration_ms=round((timings.finished_at or started) - started, 1),
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 finish_reason=",".join(str(c.finish_reason) for c in result.choices))

    def _end_unstarted(self, d: Delivery, exc: ServiceError) -> None:
        """End a claimed job that never reached the engine (nothing used: its tenant is charged 0)."""
        self._end(d, self._attempt(d), exc)

    def _end(self, d: Delivery, attempt: Attempt, exc: ServiceError, *, dead: bool = False) -> None:
        """End the job with ``exc`` after ``attempt``'s events; its tenant is charged what the
        attempt used. ``dead``: also into the dead-letter stream."""
        # The code, not the message: that can quote the request (an engine's or a template's
        # error); the client and the job record get it.
        log.info("job_ended", job_id=d.job_id, code=exc.code)
        out = attempt.end(exc)
        assert out.terminal is not None
        self._emit(d, out.terminal, data=out.data, entry_id=d.entry_id, log=out.log, usage=attempt.usage,
                   history=attempt.encoded, history_from=attempt.base, dead=dead)

    def _cancel_requested(self, job_id: str) -> bool:
        """A cancel notice on the control channel (DELETE /v1/jobs/{id})."""
        if not self.cancel_job(job_id, JobCancelled("job was cancelled")):
            return False
        log.info("job_cancel_requested", job_id=job_id, **self._traced(job_id))  # still running until its task ends
        return True

    def cancel_job(self, job_id: str, reason: ServiceError) -> bool:
        running = self._running.get(job_id)
        if running is None:
            suspect = self._suspects.get(job_id)
            if suspect is None:
                return False
            suspect.stop_reason = suspect.stop_reason or reason  # acted on at its turn (_run_suspects)
            return True
        running.stop_reason = reason
        running.task.cancel()
        return True

    # --- engine deaths ------------------------------------------------------------------------

    def _engine_died(self, d: Delivery, attempt: Attempt) -> None:
        """The engine died under job ``d`` (its task saw EngineDead and wrote nothing more). The
        job alone in the engine that died is its killer: dead-lettered now. Any other is a
        suspect, continued after the rebuild; the first to tell starts the recovery."""
        if self._alone == d.job_id:
            log.error("engine_killed_by_job", job_id=d.job_id)
            self._end(d, attempt, EngineFault("this request made the engine fail while it ran alone in it: it "
                                              "is not run again"), dead=True)
            return
        self._suspects[d.job_id] = _Suspect(d, attempt)
        self._engine_down()

    def _engine_down(self) -> None:
        """The engine is dead: the first to see it (a job's EngineDead, or the heartbeat of an idle
        worker) stops the reads and starts the recovery. The jobs then in the engine are the ones a
        failed step can be blamed on (a job picked as it died never reached it)."""
        if not self._engine_up.is_set():
            return  # seen already: the recovery under way deals with it
        self._engine_up.clear()
        self.ready = False
        self._alive_at_death = {job_id for job_id, r in self._running.items() if r.in_engine}
        assert self._tasks is not None
        self._recovery = self._tasks.create_task(self._recover(), name="engine-recovery")

    async def _recover(self) -> None:
        """After an engine death: once every job that was in it has ended here, rebuild the engine
        in place (same process, slots, heartbeat and leases: a rebuild is not a failed delivery)
        and continue its suspects one at a time; then read again. A job alone in an engine whose step
        failed is its killer: dead-lettered, never run again (an engine killed by a signal, as by the
        OOM killer or an operator, blames nobody: its jobs are all continued). Past
        LLMQ_ENGINE_RESTARTS deaths in LLMQ_ENGINE_RESTART_WINDOW_S the worker exits instead, for its
        supervisor to restart, and peers continue the suspects."""
        while self._running:  # every job in the dead engine sees its death and ends here
            await asyncio.wait([r.task for r in self._running.values()])
        cause = await self._died(len(self._alive_at_death))
        if cause == "failed" and len(self._alive_at_death) == 1:
            killer = self._suspects.pop(next(iter(self._alive_at_death)), None)
            if killer is not None:
                self._alone = killer.delivery.job_id
                self._engine_died(killer.delivery, killer.attempt)
                self._alone = None
        while self._may_rebuild():
            log.info("engine_rebuilding", suspects=len(self._suspects))
            try:
                if self._freeze_heap:
                    gc.unfreeze()  # the dead engine's client was frozen with the rest: collectable again
                await self.engine.restart()
                await self.warm_up()
            except EngineDead:  # it died again before any job ran
                await self._died(0)
                continue
            except Exception:  # the model, the device or the disk is gone: nothing to serve with here
                log.exception("engine_rebuild_failed")
                break
            log.info("engine_rebuilt", suspects=len(self._suspects))
            if await self._run_suspects():
                self._engine_up.set()
                return
            await self._died(1)  # under a suspect alone: dead-lettered
        log.error("engine_given_up", deaths=len(self._deaths), window_s=self.settings.engine_restart_window_s,
                  suspects=len(self._suspects))
        self.failed = True
        self.stop()

    async def _died(self, jobs: int) -> Death:
        """One engine death, with ``jobs`` in it: counted, and logged with its cause."""
        cause = await self.engine.death()
        now = asyncio.get_running_loop().time()
        self._deaths = [t for t in self._deaths if now - t < self.settings.engine_restart_window_s] + [now]
        self.metrics.inc("llmq_worker_engine_deaths_total")
        log.error("engine_died", cause=cause, jobs=jobs, deaths_in_window=len(self._deaths))
        return cause

    def _may_rebuild(self) -> bool:
        """Whether the window's deaths still allow another rebuild (LLMQ_ENGINE_RESTARTS)."""
        return len(self._deaths) <= self.settings.engine_restarts

    async def _run_suspects(self) -> bool:
        """Continue the dead engine's jobs in the rebuilt one, each alone and to its end, exactly
        after its logged events (the continuation path, workers/continuation.py: the same
        attempt, whose fence this worker still holds). False when the engine died under one: that
        one was dead-lettered, and the rest wait for the next engine."""
        await self.outbox.until_empty()  # the continuation reads the log: every event of theirs in it
        while self._suspects:
            job_id = next(iter(self._suspects))
            suspect = self._suspects.pop(job_id)
            d = dataclasses.replace(suspect.delivery, last_seq=suspect.attempt.seq, reclaimed=True)
            if suspect.stop_reason is not None:
                if not isinstance(suspect.stop_reason, LeaseLost):  # a peer owns a lost one
                    self._end(d, suspect.attempt, suspect.stop_reason)
                continue
            self._alone = job_id
            try:
                with self.slots.reserve(1) as slots:
                    await self._accept(d, slots)
                if (running := self._running.get(job_id)) is not None:
                    await asyncio.wait([running.task])
            finally:
                self._alone = None
            if self.engine.dead():
                return False
        return True

    # --- publishing ---------------------------------------------------------------------------

    def _emit(self, d: Delivery, event: Done | Error, **extra) -> None:
        """End job ``d`` with ``event``, counted here and written by the outbox (``extra``: what
        its write also carries, :meth:`Outbox.end`)."""
        self.metrics.inc("llmq_worker_jobs_ended_total", outcome="done" if isinstance(event, Done) else event.code)
        if d.queued_at:  # 0: a delivery whose record is missing
            self.metrics.observe("llmq_e2e_seconds", (now_ms() - d.queued_at) / 1000)
        self.outbox.end(d, event, **extra)

    def _lose(self, job_ids: list[str]) -> None:
        """Jobs a peer took over (our lease lapsed): stop them here without writing anything."""
        for job_id in job_ids:
            running = self._running.get(job_id)
            if running is not None and isinstance(running.stop_reason, Preempted):
                continue  # handed back on purpose: stopping already
            if self.cancel_job(job_id, LeaseLost("a peer took the job over")):
                log.warning("lease_lost", job_id=job_id, **self._traced(job_id))

    # --- drain, heartbeat, control -------------------------------------------------------------

    async def _drain(self) -> None:
        if self._recovery is not None:  # a stop rebuilds nothing more: the suspects go to peers
            await _cancel(self._recovery)
        # A worker that gave up on its engine leaves its suspects' leases to lapse: a peer then
        # continues each as a failed delivery, so a job that kills every engine runs out of them.
        suspects = [] if self.failed else [s.delivery.held for s in self._suspects.values() if s.stop_reason is None]
        if not self._running and not suspects:
            return
        log.info("worker_draining", in_flight=len(self._running) + len(suspects),
                 timeout_s=self.settings.drain_timeout_s)
        tasks = [r.task for r in self._running.values()]
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
        if not pending and not suspects:
            return
        # The rest is handed back to the queue and continues from its published tokens on a peer,
        # at once, or on the next worker to start (a rolling restart, or scale to zero and back).
        # Its waiting client is bounded by its cold wait (LLMQ_COLD_WAIT_S), never left hanging.
        held = [r.held for r in self._running.values()] + suspects
        for job_id in list(self._running):
            self.cancel_job(job_id, LeaseLost("handed back on shutdown"))
        if pending:
            await asyncio.wait(pending)
        # Every event produced so far must be in the log before a peer continues after it.
        await self.outbox.until_empty()
        try:
            lost = await self.queue.renew(self.model, self.worker_id, held, hand_back_idle_ms=self._lease_ms + 60_000)
            log.info("jobs_handed_back", jobs=[h.job_id for h in held if h.job_id not in lost])
        except REDIS_DOWN as exc:  # the leases lapse instead: peers still take the jobs, later
            log.warning("hand_back_failed", error=str(exc))

    def _status(self) -> Status:
        if self._stopping.is_set():
            return "draining"
        return "ready" if self.ready else "warming"

    async def _beat(self) -> None:
        adapters = self.engine.adapter_state()
        self.metrics.set_total("llmq_worker_adapter_loads_total", adapters.loads)
        self.metrics.set_total("llmq_worker_adapter_evictions_total", adapters.evictions)
        await self.presence.beat(self._status(), self.slots.running, adapters.held)

    async def _heartbeat(self) -> None:
        # Leases are renewed at least three times per lease, so one late beat never loses a job.
        period = min(self.settings.heartbeat_s, self.settings.lease_s / 3)
        while True:
            try:
                if self._engine_up.is_set() and self.engine.dead():  # it died with no job in it
                    self._engine_down()
                await self._beat()
                held = [r.held for r in self._running.values()]
                held += [s.delivery.held for s in self._suspects.values()]
                self._lose(await self.queue.renew(self.model, self.worker_id, held))
            except REDIS_DOWN as exc:
                log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(period)


class _JobSteps:
    """One job's engine steps as the engine hands them over (:meth:`Engine.run`: from the engine's
    loop, in the job task's context): each made the attempt's emission, and
    published. A fresh job starts in the engine before its claim is confirmed
    (:meth:`Worker._start_confirming`): until then its first emission and the steps after it wait
    here, and go out with the first step after the confirmation, or when the engine is done."""

    __slots__ = ("worker", "delivery", "attempt", "merges", "claim", "first", "waiting", "ended")

    def __init__(self, worker: Worker, d: Delivery, attempt: Attempt, *, merges: bool,
                 claim: asyncio.Event | None) -> None:
        self.worker, self.delivery, self.attempt, self.merges = worker, d, attempt, merges
        self.claim = claim  # None: confirmed (or never held)
        self.first: Emission | None = None
        self.waiting: list[Step] = []
        self.ended = False

    def take(self, step: Step) -> None:
        if self.ended:
            return
        if self.claim is not None:
            if not self.claim.is_set():
                self._hold(step)
                return
            self.release()
        self._publish(step)

    def _hold(self, step: Step) -> None:
        if self.first is None and not self.waiting:
            # The step is made an emission at once (its first token's time is now), and waits.
            self.first = self.attempt.on_step(step, now_ms, join=self.merges)
        else:
            self.waiting.append(step)

    def release(self) -> None:
        """The claim is confirmed: what waited goes out, in order."""
        self.claim = None
        first, waiting, self.first, self.waiting = self.first, self.waiting, None, []
        if first is not None:
            self.ended = self.worker._published(self.delivery, self.attempt, first, self.merges)
        for step in waiting:
            if not self.ended:
                self._publish(step)

    def _publish(self, step: Step) -> None:
        out = self.attempt.on_step(step, now_ms, join=self.merges)
        if out is not None:
            self.ended = self.worker._published(self.delivery, self.attempt, out, self.merges)
