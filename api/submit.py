"""Submitting a job and following it: the path every dialect shares.

Order matters: subscribe to the job's live channel, then enqueue (record + stream entry in one
script), so the first token can never be published before we listen.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec

from api.relay import Keepalive, follow
from api.services import Services
from shared.errors import InvalidRequest
from shared.events import Event
from shared.queue import now_ms
from shared.schemas import GenerationRequest, JobRecord

__all__ = ["Submission", "submit", "enqueue_detached", "admit", "subscribe_job", "follow_job"]


@dataclass(slots=True)
class Submission:
    job_id: str
    created: int  # epoch seconds, for dialects that print it
    request: GenerationRequest  # as queued: the model filled in
    events: AsyncIterator[Event | Keepalive]


async def admit(svc: Services, req: GenerationRequest) -> GenerationRequest:
    """Route the request to its model (the default when it names none), or refuse a model that is
    not served or a generation that can never fit the context (the exact prompt-length check
    happens in the engine)."""
    limit = svc.settings.max_model_len
    if req.sampling.max_tokens >= limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{req.sampling.max_tokens} tokens for the completion alone. Please reduce the length.",
            param="max_tokens",
        )
    model = await svc.models.resolve(req.model)
    return req if req.model == model else msgspec.structs.replace(req, model=model)


def _record(req: GenerationRequest) -> JobRecord:
    return JobRecord(id=uuid.uuid4().hex, model=req.model, request=req, queued_at=now_ms())


async def enqueue_detached(svc: Services, req: GenerationRequest, idempotency_key: str | None) -> str:
    """Fire-and-poll: queue the job without following it; returns the owning job id."""
    return await svc.queue.enqueue(_record(await admit(svc, req)), idempotency_key)


async def subscribe_job(svc: Services, model: str, job_id: str, stack: AsyncExitStack) -> asyncio.Queue[bytes]:
    """Subscribe to a job's live channel; the subscription lives as long as ``stack``."""
    return await stack.enter_async_context(svc.listener.subscribe(svc.keys.live(model, job_id)))


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
) -> AsyncIterator[Event | Keepalive]:
    """The job's events; iterating to the end (or closing the iterator) closes ``stack``."""

    async def events() -> AsyncIterator[Event | Keepalive]:
        async with stack:
            async for event in follow(
                svc.queue, live, model, job_id, after_seq=after_seq, backfill=backfill,
                keepalive_s=svc.settings.sse_keepalive_s if keepalive else None,
            ):
                yield event

    return events()


async def submit(
    svc: Services, req: GenerationRequest, *, idempotency_key: str | None = None, keepalive: bool = False
) -> Submission:
    """Queue the job and return its events. The caller must iterate ``events`` (or close it):
    the subscription is released when that iterator finishes."""
    record = _record(await admit(svc, req))
    model = record.model
    stack = AsyncExitStack()
    try:
        live = await subscribe_job(svc, model, record.id, stack)
        job_id = await svc.queue.enqueue(record, idempotency_key)
        if job_id != record.id:
            # A repeated Idempotency-Key: follow the earlier job from its first event.
            live = await subscribe_job(svc, model, job_id, stack)
    except BaseException:
        await stack.aclose()
        raise
    events = follow_job(svc, stack, live, model, job_id, backfill=job_id != record.id, keepalive=keepalive)
    return Submission(job_id=job_id, created=int(record.queued_at // 1000), request=record.request, events=events)
