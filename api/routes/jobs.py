"""Fire-and-poll: ``/v1/jobs`` submit, status, event stream (with resume) and cancel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from api.dialects import render_result
from api.http import accepted, decode_body, json_response, stream_response
from api.relay import DEADLINE_GRACE_MS, KEEPALIVE, Keepalive, sse
from api.services import Svc
from api.submit import follow_job, subscribe_job
from shared.errors import InvalidRequest, JobNotFound
from shared.queue import now_ms
from shared.schemas import TERMINAL_STATUSES, GenerationRequest, JobRecord, JobView

__all__ = ["create_job", "get_job", "job_events", "cancel_job"]


def job_view(record: JobRecord) -> JobView:
    """A job as ``GET /v1/jobs/{id}`` shows it; the result in the submitting dialect's shape."""
    result = None
    if record.result is not None:
        result = render_result(record.request, record.result, record.id, int(record.queued_at // 1000))
    return JobView.of(record, result)


async def _record(svc: Svc, job_id: FromPath[str]) -> JobRecord:
    """Find the job under whichever model it was queued for (keys are per model)."""
    for model in await svc.models.ever_served():
        record = await svc.queue.get_job(model, job_id)
        if record is not None:
            return record
    raise JobNotFound(f"job {job_id} not found")


@post("/v1/jobs", opt={"dialect": "jobs"})
async def create_job(request: Request, svc: Svc) -> Response:
    """Queue a job in llmq's internal request shape; always answers 202 with the job id."""
    return await accepted(svc, request, await decode_body(request, GenerationRequest))


@get("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"})
async def get_job(svc: Svc, job_id: FromPath[str]) -> Response:
    record = await _record(svc, job_id)
    if record.status not in TERMINAL_STATUSES and record.deadline is not None and now_ms() >= record.deadline:
        # Nobody may be waiting on a fire-and-poll job: the poll that finds it overdue ends it.
        if await svc.queue.expire(record.model, job_id, grace_ms=DEADLINE_GRACE_MS):
            record = await _record(svc, job_id)
    return json_response(job_view(record))


@delete("/v1/jobs/{job_id:str}", opt={"dialect": "jobs"}, status_code=200)
async def cancel_job(svc: Svc, job_id: FromPath[str]) -> Response:
    """Cancel wherever the job is: flagged if queued, aborted on its worker if running."""
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
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an event sequence number", param="Last-Event-ID") from None
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
