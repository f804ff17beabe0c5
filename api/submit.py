"""Submitting a job and following it: the mechanics under the request path (:mod:`api.jobs`).

Order matters: follow the job on this process's relay channel for its model (sending the SUBSCRIBE
the first time), enqueue (record naming that channel + stream entry, in one script) while it takes
effect, wait for its confirmation, then read the job's log before the live events: whatever was
published before the subscription took effect is in the log. When the channel was subscribed
before the job existed (a process keeps its relay channels), nothing can precede it and the log
is not read at all; should the connection drop later, the listener's RESYNC sends the relay there.

Every job a request submits and follows is watched by that request (:mod:`api.watches`): leaving
before its terminal event cancels it. Everything about the request (owner, option headers,
Idempotency-Key, its watches) arrives in its :class:`api.context.RequestContext`.
"""

from __future__ import annotations

import functools
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec
import structlog

from api.context import RequestContext, RequestTrace
from api.follow import ColdWait, Events, Lane, Relay, follow
from api.listener import Inbox
from api.media import admit_images
from api.models import caller
from api.services import Services
from api.watches import JobWatch
from shared.admission import new_job
from shared.codec import decode_request, encode
from shared.config import ModelKind
from shared.errors import InvalidRequest, ModelNotFound
from shared.events import Event
from shared.media import default_timeout_s
from shared.schemas import GenerationRequest, JobRecord, Slo, wrong_kind
from shared.tenants import TenantConfig

__all__ = ["Submission", "Live", "Following", "submit", "enqueue_detached", "admit", "subscribe_job", "follow_job",
           "check_queueable", "check_tools", "part_key", "resolve_slo"]

log = structlog.get_logger()


@dataclass(slots=True)
class Submission:
    job_id: str
    created: int  # epoch seconds, for dialects that print it
    request: GenerationRequest  # as queued: the model filled in
    events: Events


def check_queueable(req: GenerationRequest) -> None:
    """The check of :func:`admit` that needs no Redis: a request the worker would not read back
    exactly as queued. ``max_tokens`` is never refused for its size (any int64, however far past
    the context): the worker clamps it to what the context leaves after the prompt
    (shared/budget.py), and a prompt that does not fit is the engine's 400."""
    try:
        # What the worker will read back: a dialect that let an out-of-range value through (or a
        # lenient "inf") is refused here with a 400, never queued for a worker that cannot run it.
        back = decode_request(encode(req))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request: {exc}") from None
    if back != req:  # JSON has no NaN or infinity: such a number (say in a schema) would turn into null
        raise InvalidRequest("Invalid request: numbers must be finite")


def check_tools(req: GenerationRequest, tool_parser: str | None) -> None:
    """``tool_choice: auto`` needs the model's tool parser (the worker turns text into calls with
    it), as vLLM's server needs ``--tool-call-parser``; forced choices work without one."""
    if req.tools is not None and req.tools.choice == "auto" and tool_parser is None:
        raise InvalidRequest('"auto" tool choice requires a tool parser for this model: set LLMQ_TOOL_PARSER '
                             "(vLLM's --tool-call-parser), or force a tool with tool_choice", param="tool_choice")


def resolve_slo(body: Slo | None, headers: Slo | None, tenant: TenantConfig) -> Slo | None:
    """A request's SLOs, field by field: the body's, else the ``x-slo-*`` header's, else its
    tenant's default (so a header's TTFT and the tenant's TPOT make one SLO); None when none is set."""
    ttft = next((s.ttft_ms for s in (body, headers) if s is not None and s.ttft_ms is not None), tenant.slo_ttft_ms)
    tpot = next((s.tpot_ms for s in (body, headers) if s is not None and s.tpot_ms is not None), tenant.slo_tpot_ms)
    return Slo(ttft_ms=ttft, tpot_ms=tpot) if ttft is not None or tpot is not None else None


async def admit(svc: Services, ctx: RequestContext, req: GenerationRequest) -> GenerationRequest:
    """Route the request to its model (the default when it names none) and fill in what the body
    left unset from the request's option headers and its tenant's defaults; or refuse a model this
    deployment does not know (the prompt-length check happens in the engine, which knows the
    prompt's tokens). A known model is admitted whether or not a worker is warm: the job waits in
    its queue. Images are stored last (api/media.py): the request returned holds their references."""
    if ctx.bad_option is not None:
        raise ctx.bad_option
    changes: dict[str, object] = {}
    # The tenant's settings are read here and again by the enqueue: the second is the cache's
    # (ConfigCache), no round trip.
    slo = resolve_slo(req.slo, ctx.slo, await svc.tenants.get(ctx.tenant))
    if slo != req.slo:
        changes["slo"] = slo
    if req.priority is None:  # an explicit body priority (0 too) wins over the header
        changes["priority"] = ctx.priority if ctx.priority is not None else 0
    if req.timeout_s is None and ctx.timeout_s is not None:
        changes["timeout_s"] = ctx.timeout_s
    if req.cache_key is None and ctx.affinity is not None:
        changes["cache_key"] = ctx.affinity[:1024]
    if req.test_fault != ctx.test_fault:  # the header alone marks a fault test's job, never a body
        changes["test_fault"] = ctx.test_fault
    if changes:
        req = msgspec.structs.replace(req, **changes)
    check_queueable(req)
    check_tools(req, svc.settings.tool_parser_name)
    model, adapter = await svc.models.target(req.model, caller(svc, ctx))
    if req.model != model or req.adapter != adapter:
        req = msgspec.structs.replace(req, model=model, adapter=adapter)
    await check_kind(svc, req)
    # Last, once the request is otherwise admissible and its model known: every image read,
    # checked and stored by hash (api/media.py), so the record holds references only. The same
    # request object when it has no image.
    return await admit_images(svc.media, req)


async def check_kind(svc: Services, req: GenerationRequest) -> None:
    """Refuse a job its model does not make (an embedding of a generator, a completion of an
    embedder) with its dialect's 400, by what the model's workers last reported (shared/media.py
    ModelInfo), or for LLMQ_MODEL by this deployment's own LLMQ_MODEL_KIND. A model no worker has
    reported yet takes the job: its worker refuses it the same way if it must."""
    info = await svc.media.infos.get(req.model) if svc.media is not None else None
    kind = info.kind if info is not None else svc.settings.kind if req.model == svc.model else None
    if kind is not None and kind != req.kind:
        raise wrong_kind(kind)


async def default_of_kind(svc: Services, kind: ModelKind) -> str:
    """The model a request of ``kind`` goes to when it names none (TEI's, and vLLM's rerank and score
    without ``model``): LLMQ_MODEL when it is of that kind, else the first known model whose workers
    say they are; none: the dialect's 404."""
    if kind == svc.settings.kind:
        return svc.model
    for name in await svc.models.known():
        info = await svc.media.infos.get(name) if svc.media is not None else None
        if info is not None and info.kind == kind:
            return name
    raise ModelNotFound(f"no {kind} model is served here: name one as `model`", param="model")


def _record(svc: Services, ctx: RequestContext, req: GenerationRequest) -> JobRecord:
    if req.webhook and not svc.settings.webhook_secret:
        raise InvalidRequest("webhooks are not configured on this server (LLMQ_WEBHOOK_SECRET)", param="webhook")
    default = default_timeout_s(req, svc.settings.deadline_s, svc.settings.media_ttl_s)
    record = new_job(req, owner=ctx.owner, default_timeout_s=default, tenant=ctx.tenant,
                     traceparent=ctx.span.traceparent if ctx.span is not None else None,
                     max_model_len=svc.settings.max_model_len)
    if ctx.span is not None:
        ctx.span.queued(record.id, record.model, ctx.tenant, req.dialect)
    if svc.settings.log_requests:  # LLMQ_LOG_REQUESTS: the only log line that holds a prompt, at debug
        log.debug("job_request", job_id=record.id, model=record.model, request=req)
    return record


def part_key(idempotency_key: str | None, part: int, parts: int) -> str | None:
    """The Idempotency-Key of job ``part`` of a request that queues ``parts`` jobs (a list of
    prompts): one key covers the whole request."""
    if idempotency_key is None or parts == 1:
        return idempotency_key
    return f"{idempotency_key}#{part}"


def _scoped_key(ctx: RequestContext, part: int, parts: int) -> str | None:
    """An Idempotency-Key is per API key: another key reusing it must not reach this job."""
    key = part_key(ctx.idempotency_key, part, parts)
    return f"{ctx.owner}:{key}" if key and ctx.owner else key


async def enqueue_detached(svc: Services, ctx: RequestContext, req: GenerationRequest, *, part: int = 0,
                           parts: int = 1) -> str:
    """Fire-and-poll: queue the job without following it; returns the owning job id. Not watched:
    the job outlives the request that queued it."""
    record = _record(svc, ctx, await admit(svc, ctx, req))
    return await svc.queue.enqueue(record, _scoped_key(ctx, part, parts), max_queued=svc.settings.max_queued,
                                   tenant=await svc.tenants.get(ctx.tenant),
                                   capacity=await svc.models.capacity(record.model),
                                   slo_margin_ms=svc.settings.slo_margin_ms)


@dataclass(frozen=True, slots=True)
class Live:
    """A subscription to one job's events (on its relay channel); it lasts as long as ``stack``."""

    model: str
    job_id: str
    stack: AsyncExitStack
    messages: Inbox


async def subscribe_job(svc: Services, model: str, job_id: str, stack: AsyncExitStack) -> Live:
    """Follow an existing job's events; the subscription lives as long as ``stack``. Its record
    names this process's relay channel once the subscription is in effect, so every later event
    comes live and every earlier one is in the log."""
    channel = svc.relay_channel(model, job_id)
    messages = await stack.enter_async_context(svc.listener.follow(channel, job_id))
    await svc.queue.add_follower(model, job_id, channel)
    return Live(model, job_id, stack, messages)


@dataclass(slots=True)
class Following:
    """What ends with a followed job's relay (:class:`api.follow.Watcher`): its subscription; a
    watch, which cancels the job if the relay ends before the terminal event; a span, told how
    the job ended."""

    live: Live
    watch: JobWatch | None = None
    span: RequestTrace | None = None

    def ended(self, event: Event) -> None:
        if self.watch is not None:
            self.watch.finished = True
        if self.span is not None:
            self.span.ended(event)

    async def closed(self) -> None:
        try:
            await self.live.stack.aclose()  # the subscription
        finally:
            if self.watch is not None:
                self.watch.cancel()  # a no-op once the terminal event went out
                if self.watch.scope is not None:
                    self.watch.scope.discard(self.watch)  # a long LMTP socket keeps only live streams


def follow_job(
    svc: Services,
    live: Live,
    *,
    after_seq: int = 0,
    backfill: bool = False,
    keepalive: bool = False,
    watch: JobWatch | None = None,
    deadline: float | None = None,
    span: RequestTrace | None = None,
) -> Relay:
    """The job's events; iterating to the end (or closing the iterator) closes the subscription.
    With a ``watch``, leaving before the terminal event (closed, cancelled, failed) cancels the job.
    ``span``: the request's span (tracing on), told how the job ended."""
    # Only the request that queued the job waits for a worker with a bound; other readers (a poll's
    # event stream, a repeated Idempotency-Key) follow whatever happens to it.
    cold = None
    if watch is not None and svc.settings.cold_wait_s > 0:
        cold = ColdWait(functools.partial(svc.models.warm, live.model), svc.settings.cold_wait_s)
    lane = Lane()
    return Relay(follow(svc.queue, live.messages, live.model, live.job_id, after_seq=after_seq, backfill=backfill,
                        capacity=functools.partial(svc.models.capacity, live.model) if keepalive else None,
                        keepalive_s=svc.settings.sse_keepalive_s if keepalive else None, deadline=deadline,
                        cold=cold, watcher=Following(live, watch, span), lane=lane), lane)


async def submit(svc: Services, ctx: RequestContext, req: GenerationRequest, *, keepalive: bool = False,
                 part: int = 0, parts: int = 1) -> Submission:
    """Queue the job and return its events. The caller must iterate ``events`` (or close it):
    the subscription is released when that iterator finishes. ``part`` of ``parts``: this job's
    place among the jobs of one request (its Idempotency-Key is derived from the request's)."""
    record = _record(svc, ctx, await admit(svc, ctx, req))
    model = record.model
    if parts == 1:  # the API's log lines for this request name its job (one request, one job)
        structlog.contextvars.bind_contextvars(job_id=record.id, model=model)
    stack = AsyncExitStack()
    # Watched from before the first await that could queue it: a request cancelled while the
    # enqueue is in flight (an LMTP socket closing) still cancels the job it may have queued.
    watch = JobWatch(svc, model, record.id, stack, scope=ctx.watches)
    if watch.scope is not None:
        watch.scope.add(watch)
    try:
        # Subscribed while the job is queued (a round trip less before it starts); the events
        # published before the subscription took effect are read from the log (backfill below).
        await svc.keep_relays(model)
        channel = svc.relay_channel(model, record.id)
        messages = await stack.enter_async_context(svc.listener.follow(channel, record.id, wait=False))
        # Subscribed since before this job existed (the usual case: a process keeps its relay
        # channels), so every event of it comes live: reading its log first would only repeat them.
        backfill = not svc.listener.in_effect(channel)
        live = Live(model, record.id, stack, messages)
        job_id = await svc.queue.enqueue(record, _scoped_key(ctx, part, parts), max_queued=svc.settings.max_queued,
                                         relay=channel, tenant=await svc.tenants.get(ctx.tenant),
                                         capacity=await svc.models.capacity(model),
                                         slo_margin_ms=svc.settings.slo_margin_ms)
        await svc.listener.confirmed(channel)
        if job_id != record.id:
            # A repeated Idempotency-Key: follow the earlier job from its first event. That job
            # belongs to whoever queued it first, so leaving early must not cancel it. Its answer
            # is the earlier one, byte for byte: its own request and creation time.
            watch.finished = True
            live = await subscribe_job(svc, model, job_id, stack)
            backfill = True
            record = await svc.queue.get_job(model, job_id) or record
    except BaseException:
        # Cancelled or failed after the enqueue may have run: nobody will follow the job. (A
        # failure before it finds no record, and the cancel is a no-op.)
        watch.cancel()
        await stack.aclose()
        raise
    ours = watch.job_id == job_id
    events = follow_job(svc, live, backfill=backfill, keepalive=keepalive, watch=watch if ours else None,
                        deadline=record.deadline if ours else None, span=ctx.span)
    return Submission(job_id=job_id, created=int(record.queued_at // 1000), request=record.request, events=events)
