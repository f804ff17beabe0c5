"""Fire-and-poll: ``/v1/jobs`` submit, status, event stream (with resume) and cancel.

An id that starts with ``grp-`` is a group: the jobs of one request that fanned out (a list of
prompts, LMI's dynamic batch) queued with ``Prefer: respond-async``, read and cancelled as one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from api.context import Ctx, Job, JobRef
from api.dialects import render_result
from api.fanout import group_view
from api.http import accepted, decode_body, json_response, stream_response
from api.relay import DEADLINE_GRACE_MS
from api.services import Svc
from api.submit import follow_job, subscribe_job
from shared.egress import Refused, check_url, policy
from shared.errors import InvalidRequest, JobNotFound
from shared.events import Event
from shared.framing import KEEPALIVE, Keepalive, sse
from shared.queue import now_ms
from shared.schemas import TERMINAL_STATUSES, GenerationRequest, JobGroup, JobRecord, JobView

__all__ = ["create_job", "get_job", "job_events", "cancel_job"]


def job_view(record: JobRecord) -> JobView:
    """A job as ``GET /v1/jobs/{id}`` shows it; the result in the submitting dialect's shape."""
    result = None
    if record.result is not None:
        result = render_result(record.request, record.result, record.id, int(record.queued_at // 1000))
    return JobView.of(record, result)


async def _reread(svc: Svc, job: JobRef) -> JobRecord:
    record = await svc.queue.get_job(job.model, job.id)
    if record is None:  # expired since it was found
        raise JobNotFound(f"job {job.id} not found")
    return record


@post("/v1/jobs", opt={"dialect": "jobs"})
async def create_job(request: Request, svc: Svc, ctx: Ctx) -> Response:
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
    return await accepted(svc, ctx, req)


@get("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"})
async def get_job(svc: Svc, job: Job) -> Response:
    match job.found:
        case JobGroup() as group:
            return json_response(await group_view(svc, group))
        case JobRecord() as record:
            if record.status not in TERMINAL_STATUSES and record.deadline is not None and now_ms() >= record.deadline:
                # Nobody may be waiting on a fire-and-poll job: the poll that finds it overdue ends it.
                if await svc.queue.expire(job.model, job.id, grace_ms=DEADLINE_GRACE_MS):
                    record = await _reread(svc, job)
            return json_response(job_view(record))


@delete("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"}, status_code=200)
async def cancel_job(svc: Svc, job: Job) -> Response:
    """Cancel wherever the job is: flagged if queued, aborted on its worker if running."""
    match job.found:
        case JobGroup() as group:
            for member in group.jobs:
                await svc.queue.cancel(group.model, member)
            return json_response(await group_view(svc, group))
        case JobRecord():
            if await svc.queue.cancel(job.model, job.id) is None:
                raise JobNotFound(f"job {job.id} not found")
            return json_response(job_view(await _reread(svc, job)))


async def _iterate(events: list[Event]) -> AsyncIterator[Event | Keepalive]:
    for event in events:
        yield event


@get("/v1/jobs/{job_id:str}/events", opt={"dialect": "jobs"})
async def job_events(request: Request, svc: Svc, job: Job) -> Stream:
    """The job's events as SSE, ``id:`` = sequence number; resumes after ``Last-Event-ID``.
    It reads the log first, then live events, so it works for finished and running jobs alike."""
    last_event_id = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    try:
        after = int(last_event_id)
        if not 0 <= after < 2**63:  # a stream entry id's range: Redis would refuse it mid-stream
            raise ValueError
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an event sequence number", param="Last-Event-ID") from None
    if isinstance(job.found, JobGroup):
        raise InvalidRequest(f"job {job.id} is a group of {len(job.found.jobs)} jobs: read each one's events at "
                             f"/v1/jobs/<id>/events, for ids in {job.found.jobs}", param="job_id")
    events: AsyncIterator[Event | Keepalive]
    if job.found.status in TERMINAL_STATUSES:
        # Finished: its log holds every event there will be, so nothing is subscribed; resumed
        # after its last event, the stream is empty and ends, rather than waiting for more.
        events = _iterate(await svc.queue.read_events(job.model, job.id, after))
    else:
        live = await subscribe_job(svc, job.model, job.id, AsyncExitStack())
        events = follow_job(svc, live, after_seq=after, backfill=True, keepalive=True, deadline=job.found.deadline)

    async def frames() -> AsyncIterator[bytes]:
        async for event in events:
            yield KEEPALIVE if isinstance(event, Keepalive) else sse(event, event_id=event.seq)

    return stream_response(frames(), "text/event-stream")
