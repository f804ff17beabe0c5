"""Submitting a job and following it: the path every dialect shares.

Order matters: send the SUBSCRIBE for the job's live channel, enqueue (record + stream entry in
one script) while it takes effect, wait for its confirmation, then read the job's log before the
live events: whatever was published before the subscription took effect is in the log.

Cancel on disconnect: every job a request submits (not fire-and-poll ones) is watched by that
request (:class:`JobWatch`, registered before the enqueue awaits). When the request ends (the
response is done, the client disconnected, the LMTP socket closed) any watched job whose
terminal event was not relayed is cancelled; the worker aborts it in the engine. Ending early
is the only trigger: a job that finished is never cancelled, whoever reads it later.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
import structlog

from api.auth import current_owner
from api.relay import ColdWait, Keepalive, follow
from api.services import Services
from shared.codec import decode_request, encode
from shared.errors import InvalidRequest
from shared.events import Event, is_terminal
from shared.queue import now_ms
from shared.redis import REDIS_DOWN
from shared.schemas import GenerationRequest, JobRecord

__all__ = ["Submission", "submit", "enqueue_detached", "cancel_quietly", "admit", "subscribe_job", "follow_job",
           "JobWatch", "watching", "end_watches", "header_options", "check_queueable", "TIMEOUT_HEADER",
           "PRIORITY_HEADER"]

# Per-request options every dialect accepts as headers (most wire formats have no field for them).
TIMEOUT_HEADER = "x-llmq-timeout"
"""Seconds from enqueue until the request must have finished (its deadline)."""
PRIORITY_HEADER = "x-llmq-priority"
"""An integer, lower runs earlier; a body field (OpenAI's ``priority``) wins over it."""

header_options: ContextVar[tuple[str | None, str | None]] = ContextVar("llmq_header_options", default=(None, None))
"""The raw (timeout, priority) headers of the request being served (set by api.http's middleware)."""

log = structlog.get_logger()


@dataclass(eq=False, slots=True)
class JobWatch:
    """A job that lives only as long as the request that submitted it."""

    svc: Services
    model: str
    job_id: str
    stack: AsyncExitStack
    finished: bool = False  # its terminal event was relayed (or it was already cancelled)
    scope: set[JobWatch] | None = None  # the request's watches, left once the relay is closed

    def cancel(self) -> asyncio.Task[None] | None:
        """Cancel the job (in the background: this may run inside a cancelled scope)."""
        if self.finished:
            return None
        self.finished = True
        return self.svc.spawn(cancel_quietly(self.svc, self.model, self.job_id))


async def cancel_quietly(svc: Services, model: str, job_id: str) -> None:
    """Cancel a job nobody will follow; a Redis outage is logged, not raised (runs in the background)."""
    try:
        status = await svc.queue.cancel(model, job_id)
    except REDIS_DOWN as exc:
        log.warning("cancel_on_disconnect_failed", job_id=job_id, error=str(exc))
        return
    if status in ("queued", "running"):
        log.info("job_cancelled_on_disconnect", job_id=job_id, model=model, was=status)


_watches: ContextVar[set[JobWatch] | None] = ContextVar("llmq_watches", default=None)


@contextmanager
def watching() -> Iterator[set[JobWatch]]:
    """Scope one request (or socket): jobs submitted inside are collected in the yielded set."""
    watches: set[JobWatch] = set()
    token = _watches.set(watches)
    try:
        yield watches
    finally:
        _watches.reset(token)


async def end_watches(watches: set[JobWatch]) -> None:
    """The request is over: cancel its unfinished jobs, release subscriptions nobody closed."""
    pending = list(watches)
    tasks = [t for t in (w.cancel() for w in pending) if t is not None]
    for w in pending:
        await w.stack.aclose()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class Submission:
    job_id: str
    created: int  # epoch seconds, for dialects that print it
    request: GenerationRequest  # as queued: the model filled in
    events: AsyncIterator[Event | Keepalive]


def check_queueable(req: GenerationRequest, max_model_len: int) -> None:
    """The checks of :func:`admit` that need no Redis: a generation that can never fit the
    context, or a request the worker would not read back exactly as queued."""
    if req.sampling.max_tokens >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{req.sampling.max_tokens} tokens for the completion alone. Please reduce the length.",
            param="max_tokens",
        )
    try:
        # What the worker will read back: a dialect that let an out-of-range value through (or a
        # lenient "inf") is refused here with a 400, never queued for a worker that cannot run it.
        back = decode_request(encode(req))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request: {exc}") from None
    if back != req:  # JSON has no NaN or infinity: such a number (say in a schema) would turn into null
        raise InvalidRequest("Invalid request: numbers must be finite")


async def admit(svc: Services, req: GenerationRequest) -> GenerationRequest:
    """Route the request to its model (the default when it names none), or refuse a model this
    deployment does not know or a generation that can never fit the context (the exact
    prompt-length check happens in the engine). A known model is admitted whether or not a worker
    is warm: the job waits in its queue."""
    req = _with_header_options(req)
    check_queueable(req, svc.settings.max_model_len)
    model = await svc.models.resolve(req.model)
    return req if req.model == model else msgspec.structs.replace(req, model=model)


def _with_header_options(req: GenerationRequest) -> GenerationRequest:
    timeout, priority = header_options.get()
    changes: dict[str, object] = {}
    if timeout is not None and req.timeout_s is None:
        try:
            changes["timeout_s"] = float(timeout)
        except ValueError:
            raise InvalidRequest("X-LLMQ-Timeout must be a number of seconds", param="X-LLMQ-Timeout") from None
    if priority is not None and req.priority == 0:
        try:
            changes["priority"] = int(priority)
        except ValueError:
            raise InvalidRequest("X-LLMQ-Priority must be an integer", param="X-LLMQ-Priority") from None
    return msgspec.structs.replace(req, **changes) if changes else req


def _record(svc: Services, req: GenerationRequest) -> JobRecord:
    queued_at = now_ms()
    timeout_s = req.timeout_s or svc.settings.deadline_s
    if req.webhook and not svc.settings.webhook_secret:
        raise InvalidRequest("webhooks are not configured on this server (LLMQ_WEBHOOK_SECRET)", param="webhook")
    record = JobRecord(id=uuid.uuid4().hex, model=req.model, request=req, queued_at=queued_at,
                       owner=current_owner.get(), deadline=queued_at + timeout_s * 1000 if timeout_s else None,
                       webhook=req.webhook)
    if svc.settings.log_requests:  # LLMQ_LOG_REQUESTS: the only log line that holds a prompt, at debug
        log.debug("job_request", job_id=record.id, model=record.model, request=req)
    return record


def _scoped_key(record: JobRecord, idempotency_key: str | None) -> str | None:
    """An Idempotency-Key is per API key: another key reusing it must not reach this job."""
    if idempotency_key and record.owner:
        return f"{record.owner}:{idempotency_key}"
    return idempotency_key


async def enqueue_detached(svc: Services, req: GenerationRequest, idempotency_key: str | None) -> str:
    """Fire-and-poll: queue the job without following it; returns the owning job id. Not watched:
    the job outlives the request that queued it."""
    record = _record(svc, await admit(svc, req))
    return await svc.queue.enqueue(record, _scoped_key(record, idempotency_key), max_queued=svc.settings.max_queued)


async def subscribe_job(svc: Services, model: str, job_id: str, stack: AsyncExitStack, *, wait: bool = True
                        ) -> asyncio.Queue[bytes]:
    """Subscribe to a job's live channel; the subscription lives as long as ``stack``."""
    return await stack.enter_async_context(svc.listener.subscribe(svc.keys.live(model, job_id), wait=wait))


def follow_job(
    svc: Services,
    stack: AsyncExitStack,
    live: asyncio.Queue[bytes],
    model: str,
    job_id: str,
    *,
    after_seq: int = 0,
    backfill: bool = False,
    keepalive: bool = False,
    watch: JobWatch | None = None,
    deadline: float | None = None,
) -> AsyncIterator[Event | Keepalive]:
    """The job's events; iterating to the end (or closing the iterator) closes ``stack``. With a
    ``watch``, leaving before the terminal event (closed, cancelled, failed) cancels the job."""

    # Only the request that queued the job waits for a worker with a bound; other readers (a poll's
    # event stream, a repeated Idempotency-Key) follow whatever happens to it.
    cold = None
    if watch is not None and svc.settings.cold_wait_s > 0:
        cold = ColdWait(functools.partial(svc.models.warm, model), svc.settings.cold_wait_s)

    async def events() -> AsyncIterator[Event | Keepalive]:
        try:
            async with stack:
                async for event in follow(
                    svc.queue, live, model, job_id, after_seq=after_seq, backfill=backfill,
                    keepalive_s=svc.settings.sse_keepalive_s if keepalive else None, deadline=deadline, cold=cold,
                ):
                    if watch is not None and not isinstance(event, Keepalive) and is_terminal(event):
                        watch.finished = True
                    yield event
        finally:
            if watch is not None:
                watch.cancel()  # a no-op once the terminal event went out
                if watch.scope is not None:
                    watch.scope.discard(watch)  # a long LMTP socket keeps only live streams

    return events()


async def submit(
    svc: Services, req: GenerationRequest, *, idempotency_key: str | None = None, keepalive: bool = False
) -> Submission:
    """Queue the job and return its events. The caller must iterate ``events`` (or close it):
    the subscription is released when that iterator finishes."""
    record = _record(svc, await admit(svc, req))
    model = record.model
    stack = AsyncExitStack()
    # Watched from before the first await that could queue it: a request cancelled while the
    # enqueue is in flight (an LMTP socket closing) still cancels the job it may have queued.
    watch = JobWatch(svc, model, record.id, stack, scope=_watches.get())
    if watch.scope is not None:
        watch.scope.add(watch)
    try:
        # Subscribed while the job is queued (a round trip less before it starts); the events
        # published before the subscription took effect are read from the log (backfill below).
        live = await subscribe_job(svc, model, record.id, stack, wait=False)
        job_id = await svc.queue.enqueue(record, _scoped_key(record, idempotency_key),
                                         max_queued=svc.settings.max_queued)
        await svc.listener.confirmed(svc.keys.live(model, record.id))
        if job_id != record.id:
            # A repeated Idempotency-Key: follow the earlier job from its first event. That job
            # belongs to whoever queued it first, so leaving early must not cancel it.
            watch.finished = True
            live = await subscribe_job(svc, model, job_id, stack)
    except BaseException:
        # Cancelled or failed after the enqueue may have run: nobody will follow the job. (A
        # failure before it finds no record, and the cancel is a no-op.)
        watch.cancel()
        await stack.aclose()
        raise
    ours = job_id == record.id
    events = follow_job(svc, stack, live, model, job_id, backfill=True, keepalive=keepalive,
                        watch=watch if ours else None, deadline=record.deadline if ours else None)
    return Submission(job_id=job_id, created=int(record.queued_at // 1000), request=record.request, events=events)
