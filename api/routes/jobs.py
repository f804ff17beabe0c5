"""Fire-and-poll: ``/v1/jobs`` submit, status, event stream (with resume) and cancel.

An id that starts with ``grp-`` is a group: the jobs of one request that fanned out (a list of
prompts, LMI's dynamic batch) queued with ``Prefer: respond-async``, read and cancelled as one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TypeVar

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from api.dialects import render_result
from api.fanout import group_view
from api.http import accepted, decode_body, json_response, stream_response
from api.relay import DEADLINE_GRACE_MS, KEEPALIVE, Keepalive, sse
from api.services import Svc
from api.submit import follow_job, subscribe_job
from shared.egress import Refused, check_url, policy
from shared.errors import InvalidRequest, JobNotFound
from shared.queue import now_ms
from shared.schemas import GROUP_PREFIX, TERMINAL_STATUSES, GenerationRequest, JobGroup, JobRecord, JobView

__all__ = ["create_job", "get_job", "job_events", "cancel_job"]

T = TypeVar("T")


def job_view(record: JobRecord) -> JobView:
    """A job as ``GET /v1/jobs/{id}`` shows it; the result in the submitting dialect's shape."""
    result = None
    if record.result is not None:
        result = render_result(record.request, record.result, record.id, int(record.queued_at // 1000))
    return JobView.of(record, result)


async def _find(svc: Svc, job_id: str, read: Callable[[str, str], Awaitable[T | None]]) -> T:
    """A job's (or group's) record under whichever model it was queued for (keys are per model)."""
    for model in await svc.models.known():
        found = await read(model, job_id)
        if found is not None:
            return found
    raise JobNotFound(f"job {job_id} not found")


async def _record(svc: Svc, job_id: str) -> JobRecord:
    return await _find(svc, job_id, svc.queue.get_job)


async def _group(svc: Svc, group_id: str) -> JobGroup:
    return await _find(svc, group_id, svc.queue.get_group)


@post("/v1/jobs", opt={"dialect": "jobs"})
async def create_job(request: Request, svc: Svc) -> Response:
    """Queue a job in llmq's internal request shape; always answers 202 with the job id. A webhook
    whose destination ``LLMQ_WEBHOOK_ALLOW`` refuses is a 400 before anything is queued (the
    delivery checks again, after its own lookup)."""
    req = await decode_body(request, GenerationRequest)
    # Without a secret every webhook is refused further on, so no lookup is made on a client's behalf.
    if req.webhook and svc.settings.webhook_secret:
        try:
            await check_url(policy(svc.settings.webhook_allow), req.webhook)
        except Refused as exc:
            raise InvalidRequest(f"webhook destination refused: {exc.message}", param="webhook") from None
    return await accepted(svc, request, req)


@get("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"})
async def get_job(svc: Svc, job_id: FromPath[str]) -> Response:
    if job_id.startswith(GROUP_PREFIX):
        return json_response(await group_view(svc, await _group(svc, job_id)))
    record = await _record(svc, job_id)
    if record.status not in TERMINAL_STATUSES and record.deadline is not None and now_ms() >= record.deadline:
        # Nobody may be waiting on a fire-and-poll job: the poll that finds it overdue ends it.
        if await svc.queue.expire(record.model, job_id, grace_ms=DEADLINE_GRACE_MS):
            record = await _record(svc, job_id)
    return json_response(job_view(record))


@delete("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"}, status_code=200)
async def cancel_job(svc: Svc, job_id: FromPath[str]) -> Response:
    """Cancel wherever the job is: flagged if queued, aborted on its worker if running."""
    if job_id.startswith(GROUP_PREFIX):
        group = await _group(svc, job_id)
        for member in group.jobs:
            await svc.queue.cancel(group.model, member)
        return json_response(await group_view(svc, group))
    record = await _record(svc, job_id)
    if await svc.queue.cancel(record.model, job_id) is None:
        raise JobNotFound(f"job {job_id} not found")
    return json_response(job_view(await _record(svc, job_id)))


@get("/v1/jobs/{job_id:str}/events", opt={"dialect": "jobs"})
async def job_events(request: Request, svc: Svc, job_id: FromPath[str]) -> Stream:
    """The job's events as SSE, ``id:`` = sequence number; resumes after ``Last-Event-ID``.
    It reads the log first, then live events, so it works for finished and running jobs alike."""
    last_event_id = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    try:
        after = int(last_event_id)
        if not 0 <= after < 2**63:  # a stream entry id's range: Redis would refuse it mid-stream
            raise ValueError
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an event sequence number", param="Last-Event-ID") from None
    if job_id.startswith(GROUP_PREFIX):
        group = await _group(svc, job_id)
        raise InvalidRequest(f"job {job_id} is a group of {len(group.jobs)} jobs: read each one's events at "
                             f"/v1/jobs/<id>/events, for ids in {group.jobs}", param="job_id")
    record = await _record(svc, job_id)  # 404 before any byte is sent
    model = record.model
    stack = AsyncExitStack()
    live = await subscribe_job(svc, model, job_id, stack)
    events = follow_job(svc, stack, live, model, job_id, after_seq=after, backfill=True, keepalive=True,
                        deadline=record.deadline)

    async def frames() -> AsyncIterator[bytes]:
        async for event in events:
            yield KEEPALIVE if isinstance(event, Keepalive) else sse(event, event_id=event.seq)

    return stream_response(frames(), "text/event-stream")
