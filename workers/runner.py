"""The consumer loop of one worker: read jobs sized to free engine slots, run them, publish.

Tasks (all owned by :meth:`Worker.run`):

- reader: ``XREADGROUP COUNT <free slots> BLOCK <ms>``; never holds more jobs than the engine
  can start, so nothing waits unseen inside this process.
- one task per job: iterates the engine's DELTA outputs and appends events to the outbox.
- flusher: writes everything in the outbox in one pipelined round trip; events produced by the
  same engine step for different jobs land in the same flush.
- heartbeat and control: the worker's key with a TTL, and job aborts arriving through Redis.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from shared.config import Settings
from shared.errors import EngineDead, JobCancelled, ServiceError, WorkerShutdown
from shared.events import Done, Error, Event, Timings, TokenDelta, Tokens
from shared.queue import Delivery, Outbound, Queue, now_ms
from shared.redis import REDIS_DOWN
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, JobResult, PromptInfo, Usage

__all__ = ["Worker", "Engine"]

log = structlog.get_logger()


class _Step(Protocol):
    deltas: list[TokenDelta]
    finished: bool
    prompt_tokens: int
    prompt: PromptInfo | None


class Engine(Protocol):
    """What the loop needs from an engine (``workers.engine.VllmEngine`` is the real one)."""

    def stream(self, job_id: str, req: GenerationRequest) -> AsyncIterator[_Step]: ...
    async def abort(self, job_id: str) -> None: ...


@dataclass(slots=True)
class _Running:
    task: asyncio.Task[None]
    stop_reason: ServiceError | None = None  # why we cancelled it, if we did


@dataclass(slots=True)
class _JobState:
    seq: int = 0
    builder: ResultBuilder = field(default_factory=ResultBuilder)


class Worker:
    def __init__(self, settings: Settings, queue: Queue, engine: Engine, *, worker_id: str | None = None):
        self.settings = settings
        self.queue = queue
        self.engine = engine
        self.model = settings.model_name
        self.slots = settings.max_num_seqs
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self.started_at = now_ms()
        self.ready = False
        self.failed = False  # the engine died: the process should exit non-zero
        self._running: dict[str, _Running] = {}
        self._slot_freed = asyncio.Event()
        self._outbox: list[Outbound] = []
        self._outbox_ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closing = False  # set after the drain: the flusher exits once the outbox is empty

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
            await self.warm_up()
            await self._beat()
            log.info("worker_ready", worker=self.worker_id, slots=self.slots)
            flusher = tg.create_task(self._flusher())
            control = tg.create_task(self._control())
            await self._reader()
            await self._drain()
            for task in (heartbeat, control):
                task.cancel()
            # Let the flusher write what is left; cancelling it could drop a batch mid-write.
            self._closing = True
            self._outbox_ready.set()
            await flusher
        await self._unregister()

    # --- reading ------------------------------------------------------------------------------

    async def _reader(self) -> None:
        delay = 0.1
        while not self._stopping.is_set():
            free = self.slots - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                deliveries = await self.queue.read_new(self.model, self.worker_id, free, self.settings.block_ms)
                delay = 0.1
            except REDIS_DOWN as exc:
                log.warning("redis_read_failed", retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            for delivery in deliveries:
                self._accept(delivery)

    def _accept(self, d: Delivery) -> None:
        if d.state == "missing":
            # The record expired or was never written: nothing to answer; just clear the entry.
            log.warning("job_record_missing", job_id=d.job_id)
            self._emit(d.job_id, Error(seq=1, code="job_missing", message="job record not found", status=404),
                       entry_id=d.entry_id)
        elif d.state == "cancelled":
            exc = JobCancelled("job was cancelled before it started")
            self._emit(d.job_id, Error(seq=1, code=exc.code, message=exc.message, status=exc.status),
                       entry_id=d.entry_id)
        else:
            assert d.request is not None
            task = asyncio.create_task(self._run_job(d, d.request), name=f"job-{d.job_id}")
            self._running[d.job_id] = _Running(task=task)

    # --- one job ------------------------------------------------------------------------------

    async def _run_job(self, d: Delivery, req: GenerationRequest) -> None:
        state = _JobState()
        timings = Timings(queued_at=d.queued_at, started_at=now_ms())
        usage = Usage()
        with structlog.contextvars.bound_contextvars(job_id=d.job_id, model=self.model, worker=self.worker_id):
            try:
                async for step in self.engine.stream(d.job_id, req):
                    usage.prompt_tokens = step.prompt_tokens or usage.prompt_tokens
                    deltas = [x for x in step.deltas if x.token_ids or x.text or x.finish_reason]
                    usage.completion_tokens += sum(len(x.token_ids) for x in deltas)
                    first_token_at = None
                    if timings.first_token_at is None and usage.completion_tokens:
                        first_token_at = timings.first_token_at = now_ms()
                    if step.finished:
                        timings.finished_at = now_ms()
                        state.seq += 1
                        done = Done(seq=state.seq, deltas=deltas, prompt=step.prompt, usage=usage, timings=timings)
                        state.builder.add(done)
                        result = state.builder.result()
                        self._emit(d.job_id, done, entry_id=d.entry_id, result=result, first_token_at=first_token_at)
                        self._log_finished(timings, usage, result)
                        return
                    if deltas or step.prompt is not None:
                        state.seq += 1
                        event = Tokens(seq=state.seq, deltas=deltas, prompt=step.prompt)
                        state.builder.add(event)
                        self._emit(d.job_id, event, first_token_at=first_token_at)
                raise ServiceError("the engine ended the job without a final output")
            except asyncio.CancelledError:
                reason = self._running[d.job_id].stop_reason
                if reason is None:
                    raise
                await self.engine.abort(d.job_id)
                self._fail(d, state, reason)
            except EngineDead as exc:
                # Fatal for the process: fail this job, stop taking work, exit to be restarted.
                self._fail(d, state, exc)
                self.failed = True
                self.stop()
            except ServiceError as exc:
                self._fail(d, state, exc)
            except Exception as exc:  # an engine failure ends this job, not the worker
                log.exception("job_failed")
                self._fail(d, state, ServiceError(f"generation failed: {type(exc).__name__}: {exc}"))
            finally:
                self._running.pop(d.job_id, None)
                self._slot_freed.set()

    def _log_finished(self, timings: Timings, usage: Usage, result: JobResult) -> None:
        started = timings.started_at or timings.queued_at
        log.info(
            "job_finished",
            queue_ms=round(started - timings.queued_at, 1),
            ttft_ms=round((timings.first_token_at or started) - started, 1),
            duration_ms=round((timings.finished_at or started) - started, 1),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=",".join(str(c.finish_reason) for c in result.choices),
        )

    def _fail(self, d: Delivery, state: _JobState, exc: ServiceError) -> None:
        state.seq += 1
        log.info("job_ended", code=exc.code, message=exc.message)
        self._emit(d.job_id, Error(seq=state.seq, code=exc.code, message=exc.message, status=exc.status),
                   entry_id=d.entry_id)

    def cancel_job(self, job_id: str, reason: ServiceError) -> bool:
        running = self._running.get(job_id)
        if running is None:
            return False
        running.stop_reason = reason
        running.task.cancel()
        return True

    # --- publishing ---------------------------------------------------------------------------

    def _emit(self, job_id: str, event: Event, **extra) -> None:
        self._outbox.append(Outbound(job_id=job_id, event=event, **extra))
        self._outbox_ready.set()

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
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        delay = 0.1
        while True:
            try:
                await self.queue.flush(self.model, batch)
                return
            except REDIS_DOWN as exc:
                # Keep the batch: events are never dropped, only delayed until Redis is back.
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
        for job_id in list(self._running):
            self.cancel_job(job_id, WorkerShutdown("worker shut down before the job finished"))
        if pending:
            await asyncio.wait(pending)

    def _heartbeat_fields(self) -> dict[str, str | int | float]:
        return {
            "model": self.model,
            "slots": self.slots,
            "running": len(self._running),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started_at,
            "status": "draining" if self._stopping.is_set() else ("ready" if self.ready else "warming"),
            "last_heartbeat": now_ms(),
        }

    async def _beat(self) -> None:
        keys = self.queue.keys
        ttl_s = self.settings.heartbeat_s * 3
        pipe = self.queue.redis.pipeline(transaction=False)
        pipe.hset(keys.worker(self.worker_id), mapping=self._heartbeat_fields())
        pipe.expire(keys.worker(self.worker_id), int(ttl_s) + 1)
        if self.ready and not self._stopping.is_set():
            # The API answers health checks from this set: only warm workers are in it.
            expiry = now_ms() + ttl_s * 1000
            pipe.zadd(keys.workers(self.model), {self.worker_id: expiry})
            pipe.zadd(keys.models(), {self.model: expiry}, gt=True)  # how APIs discover models
        else:
            pipe.zrem(keys.workers(self.model), self.worker_id)
        pipe.zremrangebyscore(keys.workers(self.model), 0, now_ms())
        await pipe.execute()

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._beat()
            except REDIS_DOWN as exc:
                log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _unregister(self) -> None:
        keys = self.queue.keys
        try:
            await self.queue.redis.delete(keys.worker(self.worker_id))
            await self.queue.redis.zrem(keys.workers(self.model), self.worker_id)
        except REDIS_DOWN:
            pass

    async def _control(self) -> None:
        """Abort jobs on request (DELETE /v1/jobs/{id}); the notice names the job id."""
        channel = self.queue.keys.worker_control(self.worker_id)
        while True:
            pubsub = self.queue.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    job_id = message["data"].decode()
                    if self.cancel_job(job_id, JobCancelled("job was cancelled")):
                        log.info("job_cancel_requested", job_id=job_id)
            except REDIS_DOWN as exc:
                log.warning("control_channel_lost", error=str(exc))
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()
