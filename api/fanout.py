"""One client request, several jobs: OpenAI's list of prompts, LMI's dynamic batch.

Each prompt is its own job (so workers batch them like any other), and their events are merged
back into one stream whose choice indexes run across the jobs: job ``j``'s choice ``i`` becomes
``j * n + i``, as vLLM numbers them. The merged stream ends with one ``Done`` carrying the summed
usage, or with the first ``Error``. A job's prompt info rides on its first event, whose deltas
tell which job it belongs to.

An ``Idempotency-Key`` covers the whole request: job ``j`` is queued under ``<key>#<j>``. With
``Prefer: respond-async`` the jobs are queued as one group (:class:`shared.schemas.JobGroup`),
polled and cancelled at ``/v1/jobs/<group id>`` like one job, its result in the request's shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec

from api.context import RequestContext
from api.dialects import render_group_result
from api.follow import Events, collect
from api.models import caller
from api.services import Services
from api.submit import Submission, enqueue_detached, submit
from api.watches import cancel_quietly
from shared.errors import JobNotFound
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.framing import Keepalive
from shared.queue import now_ms
from shared.schemas import (
    GROUP_PREFIX,
    TERMINAL_STATUSES,
    GenerationRequest,
    JobError,
    JobGroup,
    JobRecord,
    JobResult,
    JobStatus,
    Usage,
)

__all__ = ["submit_all", "merge", "collect_all", "enqueue_all", "GroupView", "group_view"]


async def submit_all(svc: Services, ctx: RequestContext, reqs: list[GenerationRequest], *,
                     keepalive: bool = False) -> list[Submission]:
    subs: list[Submission] = []
    try:
        for j, req in enumerate(reqs):
            subs.append(await submit(svc, ctx, req, keepalive=keepalive and not subs, part=j, parts=len(reqs)))
    except BaseException:
        for sub in subs:
            await sub.events.aclose()
        raise
    return subs


async def enqueue_all(svc: Services, ctx: RequestContext, reqs: list[GenerationRequest]) -> str:
    """Fire-and-poll: queue the request's jobs without following them. Returns the job's id, or
    with several jobs the id of their group."""
    if len(reqs) == 1:
        return await enqueue_detached(svc, ctx, reqs[0])
    model = await svc.models.resolve(reqs[0].model, caller(svc, ctx))
    ids: list[str] = []
    try:
        for j, req in enumerate(reqs):
            ids.append(await enqueue_detached(svc, ctx, req, part=j, parts=len(reqs)))
    except BaseException:
        if ctx.idempotency_key is None:  # all or nothing: no orphan runs for a client who got an error
            for job_id in ids:
                svc.spawn(cancel_quietly(svc, model, job_id))
        raise
    group = JobGroup(id=GROUP_PREFIX + ids[0], model=model, jobs=ids, queued_at=now_ms(), owner=ctx.owner)
    # It must outlive its jobs' records, which expire LLMQ_RESULT_TTL_S after they finish.
    await svc.queue.save_group(group, svc.settings.idempotency_ttl_s + svc.settings.result_ttl_s)
    return group.id


class GroupView(msgspec.Struct, kw_only=True):
    """A group as ``GET /v1/jobs/{id}`` shows it: one status over its jobs, one result."""

    id: str
    object: str = "job.group"
    model: str
    status: JobStatus
    dialect: str
    jobs: list[str]
    queued_at: float
    started_at: float | None
    finished_at: float | None
    result: Any
    """The request's answer in its dialect's shape, once every job is done."""
    error: JobError | None


def _status(records: list[JobRecord]) -> JobStatus:
    statuses = {r.status for r in records}
    if statuses == {"done"}:
        return "done"
    if statuses <= TERMINAL_STATUSES:
        return "cancelled" if "cancelled" in statuses else "failed"
    return "queued" if statuses == {"queued"} else "running"


async def group_view(svc: Services, group: JobGroup) -> GroupView:
    found = await svc.queue.get_jobs(group.model, group.jobs)
    records = [r for r in found if r is not None]
    if len(records) != len(found):
        raise JobNotFound(f"job {group.id} not found")  # its jobs' records expired before it did
    status = _status(records)
    result = None
    if status == "done":
        reqs = [r.request for r in records]
        result = render_group_result(reqs, [r.result or JobResult() for r in records], group.id,
                                     int(group.queued_at // 1000))
    started = [r.started_at for r in records if r.started_at is not None]
    return GroupView(
        id=group.id, model=group.model, status=status, dialect=records[0].request.dialect, jobs=group.jobs,
        queued_at=group.queued_at, started_at=min(started) if started else None,
        finished_at=max(r.finished_at or 0.0 for r in records) if status in TERMINAL_STATUSES else None,
        result=result, error=next((r.error for r in records if r.error is not None), None),
    )


def _job_deltas(event: Tokens | Done, offset: int) -> list[TokenDelta]:
    """One job's deltas with its choice indexes shifted into the merged numbering."""
    deltas = event.deltas if not offset else [msgspec.structs.replace(d, index=d.index + offset) for d in event.deltas]
    if event.prompt is not None and not deltas:
        deltas = [TokenDelta(index=offset)]  # so the reader can tell whose prompt this is
    return deltas


def merge(subs: list[Submission], n: int) -> Events:
    """The jobs' events as one job's: interleaved as they arrive, indexes shifted, one terminal.
    One job's events are returned as they are: no extra generator on the per-token path."""
    return subs[0].events if len(subs) == 1 else _interleave(subs, n)


async def _interleave(subs: list[Submission], n: int) -> AsyncGenerator[Event | Keepalive, None]:
    inbox: asyncio.Queue[tuple[int, Event | Keepalive]] = asyncio.Queue()

    async def pump(j: int, events: AsyncIterator[Event | Keepalive]) -> None:
        async for item in events:
            await inbox.put((j, item))

    tasks = [asyncio.create_task(pump(j, sub.events)) for j, sub in enumerate(subs)]
    usage, open_jobs, seq = Usage(), len(subs), 0
    try:
        while open_jobs:
            j, item = await inbox.get()
            match item:
                case Keepalive():
                    if j == 0:  # one keep-alive source is enough
                        yield item
                case Error():
                    yield item
                    return
                case Tokens():
                    seq += 1
                    yield Tokens(seq=seq, deltas=_job_deltas(item, j * n), prompt=item.prompt)
                case Done():
                    seq += 1
                    open_jobs -= 1
                    usage.prompt_tokens += item.usage.prompt_tokens
                    usage.completion_tokens += item.usage.completion_tokens
                    deltas = _job_deltas(item, j * n)
                    if not open_jobs:
                        yield Done(seq=seq, deltas=deltas, prompt=item.prompt, usage=usage, timings=item.timings)
                        return
                    yield Tokens(seq=seq, deltas=deltas, prompt=item.prompt)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in subs:
            await sub.events.aclose()


async def collect_all(subs: list[Submission], on_event: Callable[[Tokens | Done], None] | None = None
                      ) -> list[JobResult]:
    """Every job's result, in order; the first failure is raised and the rest are let go.
    ``on_event`` sees each token event as it is folded."""
    try:
        if len(subs) == 1:  # one job: no task group on the common path
            return [await collect(subs[0].events, on_event)]
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(collect(sub.events, on_event)) for sub in subs]
    except* Exception as group:
        raise group.exceptions[0] from None
    finally:
        for sub in subs:
            await sub.events.aclose()
    return [task.result() for task in tasks]
