"""The consumer loop of one worker: read jobs sized to free engine slots, run them, publish.

Tasks (all owned by :meth:`Worker.run`):

- reader: first takes over jobs whose lease lapsed (``XAUTOCLAIM``: their worker died or
  stalled; they continue from their published tokens, workers/continuation.py), then new jobs,
  the most urgent priority level first (``Queue.read_new``); never holds more jobs than the
  engine can start, so nothing waits unseen inside this process.
- watcher: takes over at once the jobs of a peer whose process died, told by its control
  subscription being gone (:meth:`Presence.dead_peers`, workers/presence.py); the lease stays
  the backstop for a peer that is alive but stalled, hung or cut off.
- one task per job: iterates the engine's DELTA outputs and appends events to the outbox; a
  timer aborts it at the job's deadline.
- flusher: writes the outbox in one round trip per batch (events of one engine step together).
- heartbeat and control: the worker's key with a TTL (:class:`Presence`, which the worker owns),
  the leases of its jobs (renewed, fenced by owner and attempt: a job reclaimed by a peer is
  aborted here and written nowhere), and aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from redis.exceptions import ResponseError

from shared import eventlog
from shared.codec import encode
from shared.config import Settings
from shared.errors import (
    DeadLetter,
    DeadlineExceeded,
    EngineDead,
    GenerationFailed,
    InvalidRequest,
    JobCancelled,
    JobMissing,
    LeaseLost,
    ServiceError,
)
from shared.events import Done, Error, Event, Timings, Tokens, is_terminal
from shared.metrics import Recorder
from shared.queue import Delivery, Held, Outbound, Queue, now_ms
from shared.redis import REDIS_DOWN
from shared.registry import Registry
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, JobResult, Usage
from workers.continuation import plan_for
from workers.presence import Presence, Status
from workers.protocol import Engine

if TYPE_CHECKING:  # OpenTelemetry is imported only with tracing on
    from shared.tracing import Tracing
    from workers.tracing import JobSpans

__all__ = ["Worker"]

log = structlog.get_logger()


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


@dataclass(slots=True)
class _JobState:
    seq: int = 0
    builder: ResultBuilder = field(default_factory=ResultBuilder)
    events: list[Event] = field(default_factory=list)
    """This attempt's events, for the compact log its end leaves (:meth:`Worker._compacted`)."""


class Worker:
    def __init__(self, settings: Settings, queue: Queue, engine: Engine, *, worker_id: str | None = None,
                 device: str = "", tracing: Tracing | None = None):
        self.settings = settings
        self.tracing = tracing  # None: tracing off, and no span work anywhere below
        self.queue = queue
        self.engine = engine
        self.model = settings.model_name
        self.slots = settings.max_num_seqs
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self.ready = False
        self.failed = False  # the engine died: the process should exit non-zero
        self._running: dict[str, _Running] = {}
        self._slot_freed = asyncio.Event()
        self._outbox: list[Outbound] = []
        self._outbox_ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closing = False  # set after the drain: the flusher exits once the outbox is empty
        self._flush_lock = asyncio.Lock()  # one flush at a time: a job's events reach Redis in order
        self._lease_ms = int(settings.lease_s * 1000)
        self._next_reclaim = 0.0
        self._incoming = 0  # slots promised to jobs being claimed, not yet in _running
        self.metrics = Recorder(self.model)  # pushed with each heartbeat (shared/metrics.py)
        self.presence = Presence(settings, Registry(queue.redis, queue.keys), self.worker_id, self.metrics,
                                 device=device)

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Begin a graceful drain (SIGTERM): stop reading, let in-flight jobs finish."""
        self._stopping.set()
        self._slot_freed.set()

    async def warm_up(self) -> None:
        """Serve one request before reporting ready: the first request on CPU pays ~20 s of
        one-off compilation that no user should wait for."""
        req = GenerationRequest(prompt="warm up", dialect="jobs")
        async for _ in self.engine.stream(f"warmup-{self.worker_id}", req):
            pass
        self.ready = True

    async def run(self) -> None:
        """Warm up, serve until :meth:`stop`, drain, and leave nothing behind in Redis."""
        await self.queue.ensure_group(self.model)
        async with asyncio.TaskGroup() as tg:
            heartbeat = tg.create_task(self._heartbeat())
            control = tg.create_task(self.presence.control(self._cancel_requested))
            await self.warm_up()
            await self._beat()
            log.info("worker_ready", worker=self.worker_id, slots=self.slots)
            flusher = tg.create_task(self._flusher())
            watcher = tg.create_task(self._watch())
            await self._reader()
            await self._drain()
            await _cancel(heartbeat, control, watcher)
            # Let the flusher write what is left; cancelling it could drop a batch mid-write.
            self._closing = True
            self._outbox_ready.set()
            await flusher
        await self.presence.unregister()

    # --- reading ------------------------------------------------------------------------------

    def _room(self) -> int:
        """Free engine slots, less those promised to jobs on their way in."""
        return self.slots - len(self._running) - self._incoming

    @contextlib.contextmanager
    def _claiming(self, n: int) -> Iterator[None]:
        """Hold ``n`` slots for jobs being claimed, until they run: the reader and the watcher
        claim concurrently, and neither may fill a slot the other counted as free."""
        self._incoming += n
        try:
            yield
        finally:
            self._incoming -= n
            self._slot_freed.set()  # what was held and not filled is free again: a waiting reader reads

    async def _reader(self) -> None:
        delay = 0.1
        while not self._stopping.is_set():
            free = self._room()
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if not self.presence.control_up.is_set():
                # Without our control subscription peers would take our jobs for a dead worker's:
                # read nothing until it is (back) up. Checked again for a stop every half second.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.presence.control_up.wait()
                continue
            try:
                with self._claiming(free):
                    free -= await self._reclaim(free)
                if free > 0:
                    await self._read_new(free)
                delay = 0.1
            except REDIS_DOWN as exc:
                log.warning("redis_read_failed", retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _read_new(self, count: int) -> None:
        # The read may block for LLMQ_BLOCK_MS with ``count`` slots free, and the watcher must not
        # wait that long to take a dead peer's jobs: so the slots are held only for each pick (the
        # pick claims what it takes), sized to the room left then.
        admitted = 0

        def admit(wanted: int) -> int:
            nonlocal admitted
            self._incoming -= admitted  # the last pick's hold, if it found nothing
            admitted = max(0, min(wanted, self._room()))
            self._incoming += admitted
            return admitted

        try:
            for delivery in await self.queue.read_new(self.model, self.worker_id, count, self.settings.block_ms,
                                                      self.settings.max_deliveries, admit=admit, stop=self._stopping):
                await self._accept(delivery)
        finally:
            self._incoming -= admitted

    async def _reclaim(self, free: int) -> int:
        """Take over jobs whose lease lapsed, before any new work (they have waited longest).
        Checked at most every quarter lease; returns how many slots the taken jobs fill."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_reclaim:
            return 0
        self._next_reclaim = loop.time() + min(self.settings.lease_s / 4, 1.0)
        deliveries = await self.queue.reclaim(self.model, self.worker_id, free, self._lease_ms,
                                              max_deliveries=self.settings.max_deliveries,
                                              exclude=frozenset(self._running))
        for delivery in deliveries:
            log.info("job_reclaimed", job_id=delivery.job_id, attempt=delivery.attempt, state=delivery.state,
                     after_seq=delivery.last_seq)
        await self._adopt(deliveries)
        return len(deliveries)

    async def _adopt(self, deliveries: list[Delivery]) -> None:
        """Run jobs taken from another consumer (a lapsed lease, a dead peer): like new ones, but
        continued from their published tokens (plan_for) and counted as reclaimed."""
        self.metrics.inc("llmq_worker_jobs_reclaimed_total", len(deliveries))
        for delivery in deliveries:
            await self._accept(delivery)

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
            if self._stopping.is_set() or not self.presence.control_up.is_set():
                absent.clear()  # no use for more jobs, or no right to judge: afresh once there is
                continue
            try:
                for dead in await self.presence.dead_peers(absent, loop.time):
                    await self._take_over(dead)  # as many as there is room for; the rest next poll
            except (*REDIS_DOWN, ResponseError) as exc:  # Redis away, or its group gone (a restart)
                log.debug("watch_failed", error=str(exc))
                absent.clear()

    async def _take_over(self, dead: str) -> None:
        free = self._room()
        if free <= 0:
            return
        with self._claiming(free):
            deliveries = await self.queue.take_over(self.model, dead, self.worker_id, free,
                                                    max_deliveries=self.settings.max_deliveries)
            if deliveries:
                log.info("worker_jobs_taken_over", dead_worker=dead, jobs=[d.job_id for d in deliveries],
                         attempts=[d.attempt for d in deliveries])
            await self._adopt(deliveries)

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

    async def _accept(self, d: Delivery) -> None:
        spans = self._spans(d)
        if spans is not None and spans.trace_id:
            # Its log lines here and in its task (which copies this context) lead to its trace.
            with structlog.contextvars.bound_contextvars(trace_id=spans.trace_id):
                return await self._start(d, spans)
        return await self._start(d, spans)

    async def _start(self, d: Delivery, spans: JobSpans | None) -> None:
        if d.state == "missing":
            # The record expired or was never written: nothing to answer; just clear the entry.
            log.warning("job_record_missing", job_id=d.job_id)
            self._emit(d, Error.of(JobMissing("job record not found"), seq=1),
                       entry_id=d.entry_id, attempt=0)
        elif d.state == "finished":  # the job already ended; only its entry was left behind
            await self.queue.ack(self.model, d.entry_id, d.level)
        elif d.state == "cancelled":
            self._end(d, d.last_seq, JobCancelled("job was cancelled before it started"), usage=Usage())
        elif d.state == "expired":
            log.info("job_expired_in_queue", job_id=d.job_id, waited_ms=round(now_ms() - d.queued_at, 1))
            self._end(d, d.last_seq, DeadlineExceeded("the request's deadline passed while it was queued"),
                      usage=Usage())
        elif d.state == "invalid":
            self._end(d, d.last_seq, InvalidRequest("the queued request is not valid for this worker"), usage=Usage())
        elif d.state == "dead":
            log.warning("job_dead_lettered", job_id=d.job_id, attempt=d.attempt)
            exc = DeadLetter(f"the job was delivered {d.attempt - 1} times and no worker finished it "
                             "(workers died or stalled while running it)")
            self._emit(d, Error.of(exc, d.last_seq + 1),
                       entry_id=d.entry_id, dead=True)
        else:
            assert d.request is not None
            self.metrics.inc("llmq_worker_jobs_started_total")
            if not d.reclaimed:
                self.metrics.observe("llmq_queue_wait_seconds", (now_ms() - d.queued_at) / 1000)
            task = asyncio.create_task(self._run_job(d, d.request, spans), name=f"job-{d.job_id}")
            task.add_done_callback(functools.partial(self._cancelled_unstarted, d))
            running = _Running(task=task, held=Held(d.job_id, d.entry_id, d.attempt, d.level), spans=spans)
            if d.deadline is not None:
                running.deadline = asyncio.get_running_loop().call_later(
                    max(0.0, (d.deadline - now_ms()) / 1000), self.cancel_job, d.job_id,
                    DeadlineExceeded("the request's deadline passed while it was running"))
            self._running[d.job_id] = running

    def _cancelled_unstarted(self, d: Delivery, task: asyncio.Task[None]) -> None:
        """A job task cancelled before its first step never runs :meth:`_run_job` at all, so none
        of its handlers end the job or free its slot: a cancel notice that arrives between the
        claim and the task's start (a client's DELETE just as its job is picked). End it here."""
        running = self._running.get(d.job_id)
        if not task.cancelled() or running is None or running.task is not task:
            return  # it ran: _run_job's own handlers ended it (or it stopped with the worker)
        del self._running[d.job_id]
        if running.deadline is not None:
            running.deadline.cancel()
        reason = running.stop_reason
        if isinstance(reason, LeaseLost):
            reason = None  # a peer owns a lost lease's job: nothing to end here
        if reason is not None:
            self._end(d, d.last_seq, reason, usage=Usage())
        if running.spans is not None:
            running.spans.ended(reason.code if reason is not None else "released", Usage())
        self._slot_freed.set()

    # --- one job ------------------------------------------------------------------------------

    async def _run_job(self, d: Delivery, req: GenerationRequest, spans: JobSpans | None = None) -> None:
        state = _JobState(seq=d.last_seq)
        timings = Timings(queued_at=d.queued_at, started_at=now_ms())
        usage = Usage()
        # How the attempt ended, for its span: "released" unless a branch below says otherwise.
        outcome, result = "released", None
        # (With tracing on, trace_id is bound too: this task copied _accept's context.)
        with structlog.contextvars.bound_contextvars(job_id=d.job_id, model=self.model, worker=self.worker_id,
                                                     attempt=d.attempt):
            try:
                plan = await plan_for(self.queue, self.model, d, req)
                state.seq, state.builder = plan.seq, plan.builder
                usage.prompt_tokens, usage.completion_tokens = plan.prompt_tokens, plan.emitted
                # The first token time of a continued job was recorded by its first attempt.
                prompt_ids = None if plan.emitted else []  # [] = not yet known; None = do not store
                headers = spans.engine_started() if spans is not None else None
                if not self.settings.engine_tracing:
                    headers = None  # vLLM traces nothing: it would only warn of the headers
                async for step in self.engine.stream(d.job_id, plan.request, plan.parts, trace_headers=headers):
                    if not plan.emitted:
                        usage.prompt_tokens = step.prompt_tokens or usage.prompt_tokens
                    if prompt_ids == []:
                        prompt_ids = step.prompt_token_ids or (
                            step.prompt.token_ids if step.prompt is not None else None)
                    deltas = [x for x in step.deltas if x.token_ids or x.text or x.finish_reason]
                    tokens = sum(len(x.token_ids) for x in deltas)
                    usage.completion_tokens += tokens
                    self.metrics.inc("llmq_worker_tokens_total", tokens)
                    first_token_at = None
                    if timings.first_token_at is None and usage.completion_tokens and not plan.emitted:
                        first_token_at = timings.first_token_at = now_ms()
                        self.metrics.observe("llmq_ttft_seconds", (first_token_at - d.queued_at) / 1000)
                    if step.finished:
                        timings.finished_at = now_ms()
                        state.seq += 1
                        done = Done(seq=state.seq, deltas=deltas, prompt=step.prompt, usage=usage, timings=timings)
                        state.builder.add(done)
                        state.events.append(done)
                        result = state.builder.result()
                        self._emit(d, done, entry_id=d.entry_id, result=result, first_token_at=first_token_at,
                                   log=self._compacted(d, state.events, result))
                        self._log_finished(timings, usage, result)
                        outcome = "done"
                        return
                    if deltas or step.prompt is not None:
                        state.seq += 1
                        event = Tokens(seq=state.seq, deltas=deltas, prompt=step.prompt)
                        state.builder.add(event)
                        state.events.append(event)
                        # The prompt's ids ride the first event, so whoever sees a token in the log
                        # can also continue after it.
                        self._emit(d, event, first_token_at=first_token_at, prompt_ids=prompt_ids or None)
                        prompt_ids = None
                raise GenerationFailed("the engine ended the job without a final output")
            except asyncio.CancelledError:
                reason = self._running[d.job_id].stop_reason
                if reason is None:
                    raise
                await self.engine.abort(d.job_id)
                if isinstance(reason, LeaseLost):
                    # A peer owns the job now (or will, after a hand-back): write nothing about it.
                    log.info("job_released", reason=reason.message)
                    return
                outcome = reason.code
                self._fail(d, state, reason, usage)
            except EngineDead as exc:
                # Fatal for the process, not for the job: write nothing, stop renewing its lease
                # and exit to be restarted; a peer (or our successor) takes it over when the lease
                # lapses and continues it. Counted as a failed delivery, so a request that kills
                # every engine it reaches ends in the dead-letter stream, not in a loop.
                log.error("engine_dead_job_left_for_a_peer", error=exc.message)
                outcome = exc.code
                self.failed = True
                self.stop()
            except ServiceError as exc:
                outcome = exc.code
                self._fail(d, state, exc, usage)
            except Exception as exc:  # an engine failure ends this job, not the worker
                log.exception("job_failed", may_quote_request=True)  # an engine error may quote the prompt
                error = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
                outcome = error.code
                self._fail(d, state, error, usage)
            finally:
                if spans is not None:
                    spans.ended(outcome, usage, result)
                running = self._running.pop(d.job_id, None)
                if running is not None and running.deadline is not None:
                    running.deadline.cancel()
                self._slot_freed.set()

    def _log_finished(self, timings: Timings, usage: Usage, result: JobResult) -> None:
        started = timings.started_at or timings.queued_at
        log.info("job_finished", queue_ms=round(started - timings.queued_at, 1),
                 ttft_ms=round((timings.first_token_at or started) - started, 1),
                 duration_ms=round((timings.finished_at or started) - started, 1),
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 finish_reason=",".join(str(c.finish_reason) for c in result.choices))

    def _fail(self, d: Delivery, state: _JobState, exc: ServiceError, usage: Usage) -> None:
        self._end(d, state.seq, exc, state.events, usage=usage)
        state.seq += 1

    def _end(self, d: Delivery, last_seq: int, exc: ServiceError, events: list[Event] | None = None, *,
             usage: Usage | None = None) -> None:
        """End the job with ``exc`` after ``events`` (this attempt's, all of seq <= ``last_seq``).
        ``usage``: what this attempt used (its tenant is charged that), when it is known."""
        # The code, not the message: that can quote the request (an engine's or a template's
        # error); the client and the job record get it.
        log.info("job_ended", job_id=d.job_id, code=exc.code)
        event = Error.of(exc, last_seq + 1)
        self._emit(d, event, entry_id=d.entry_id, log=self._compacted(d, [*(events or ()), event]), usage=usage)

    @staticmethod
    def _compacted(d: Delivery, events: list[Event], result: JobResult | None = None) -> bytes | None:
        """The job's whole event log in compact form (shared/eventlog.py), which replaces its
        per-event stream as the job ends: a finished job then costs its result plus a few hundred
        bytes for LLMQ_RESULT_TTL_S, not ~180 bytes per token. Only when this attempt wrote every
        event (a fresh start): a continued job's first events came from an earlier attempt, and
        its stream is kept as it is (continuations are rare). ``result``: the one the record
        stores, which the compact form refers to rather than repeats."""
        if d.last_seq or not d.attempt:
            return None
        # Without the cyclic GC: compacting allocates thousands of short-lived dicts and lists
        # (all freed by refcount), and the collections they would trigger scan every live object
        # of the worker (every running job's events): measured, that doubled the cost per token.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return eventlog.compact(encode(events), None if result is None else encode(result))
        finally:
            if enabled:
                gc.enable()

    def _cancel_requested(self, job_id: str) -> bool:
        """A cancel notice on the control channel (DELETE /v1/jobs/{id})."""
        if not self.cancel_job(job_id, JobCancelled("job was cancelled")):
            return False
        log.info("job_cancel_requested", job_id=job_id, **self._traced(job_id))  # still running until its task ends
        return True

    def cancel_job(self, job_id: str, reason: ServiceError) -> bool:
        running = self._running.get(job_id)
        if running is None:
            return False
        running.stop_reason = reason
        running.task.cancel()
        return True

    # --- publishing ---------------------------------------------------------------------------

    def _emit(self, d: Delivery, event: Event, **extra) -> None:
        extra.setdefault("attempt", d.attempt)
        extra.setdefault("level", d.level)
        if is_terminal(event):
            self.metrics.inc("llmq_worker_jobs_ended_total", outcome="done" if isinstance(event, Done) else event.code)
            if d.queued_at:  # 0: a delivery whose record is missing
                self.metrics.observe("llmq_e2e_seconds", (now_ms() - d.queued_at) / 1000)
        self._outbox.append(Outbound(job_id=d.job_id, event=event, **extra))
        self._outbox_ready.set()

    def _lose(self, job_ids: list[str]) -> None:
        """Jobs a peer took over (our lease lapsed): stop them here without writing anything."""
        for job_id in job_ids:
            if self.cancel_job(job_id, LeaseLost("a peer took the job over")):
                log.warning("lease_lost", job_id=job_id, **self._traced(job_id))

    async def _flusher(self) -> None:
        while True:
            await self._outbox_ready.wait()
            # Let every job task woken by the same engine step add its tokens first.
            await asyncio.sleep(0)
            self._outbox_ready.clear()
            await self._flush_once()
            if self._closing and not self._outbox:
                return

    async def _flush_once(self) -> None:
        async with self._flush_lock:
            batch, self._outbox = self._outbox, []
            if not batch:
                return
            delay = 0.1
            while True:
                try:
                    self._lose(await self.queue.flush(self.model, batch, self.worker_id))
                    return
                except REDIS_DOWN as exc:
                    # Keep the batch: events are never dropped, only delayed until Redis is back.
                    # (flush.lua skips events already logged, so a retried batch writes nothing twice.)
                    log.warning("redis_flush_failed", events=len(batch), retry_in_s=delay, error=str(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    # --- drain, heartbeat, control -------------------------------------------------------------

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("worker_draining", in_flight=len(self._running), timeout_s=self.settings.drain_timeout_s)
        tasks = [r.task for r in self._running.values()]
        _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
        if not pending:
            return
        # The rest is handed back to the queue and continues from its published tokens on a peer,
        # at once, or on the next worker to start (a rolling restart, or scale to zero and back).
        # Its waiting client is bounded by its cold wait (LLMQ_COLD_WAIT_S), never left hanging.
        held = [r.held for r in self._running.values()]
        for job_id in list(self._running):
            self.cancel_job(job_id, LeaseLost("handed back on shutdown"))
        await asyncio.wait(pending)
        # Every event produced so far must be in the log before a peer continues after it.
        while self._outbox:
            await self._flush_once()
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
        await self.presence.beat(self._status(), len(self._running))

    async def _heartbeat(self) -> None:
        # Leases are renewed at least three times per lease, so one late beat never loses a job.
        period = min(self.settings.heartbeat_s, self.settings.lease_s / 3)
        while True:
            try:
                await self._beat()
                held = [r.held for r in self._running.values()]
                self._lose(await self.queue.renew(self.model, self.worker_id, held))
            except REDIS_DOWN as exc:
                log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(period)
