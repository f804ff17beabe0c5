"""Fire-and-poll: ``/v1/jobs`` submit, status, event stream (with resume) and cancel.

An id that starts with ``grp-`` is a group: the jobs of one request that fanned out (a list of
prompts, LMI's dynamic batch) queued with ``Prefer: respond-async``, read and cancelled as one."""

from __future__ import annotations

from litestar import Request, Response, delete, get, post

from api import jobs
from api.context import Ctx, Job
from api.dialects import jobs as llmq_jobs
from api.dialects import render_result
from api.dialects.stream import SSE
from api.fanout import GroupView, group_view
from api.http import EventStream, decode_body, json_response
from api.operations import ASYNC, documented
from api.query import whole_number
from api.services import Svc
from shared.egress import Refused, check_url, policy
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest, JobGroup, JobRecord, JobView
from shared.slo import Standing

__all__ = ["ROUTES", "create_job", "get_job", "job_events", "cancel_job"]

_OPT = {"dialect": llmq_jobs.NAME}
_ERROR = llmq_jobs.ErrorBody


def job_view(record: JobRecord, standing: Standing | None = None) -> JobView:
    """A job as ``GET /v1/jobs/{id}`` shows it; the result in the submitting dialect's shape, and
    while it waits its ``standing`` in the queue."""
    result = None
    if record.result is not None:
        result = render_result(record.request, record.result, record.id, int(record.queued_at // 1000))
    return JobView.of(record, result, standing)


@documented("Queue a job (llmq's internal request)", "jobs", body="job",
            examples=({"prompt": "Hello", "sampling": {"max_tokens": 4}},), ok=ASYNC, errors=(400, 404, 424, 429, 503),
            headers=("Idempotency-Key",), error=_ERROR)
@post("/v1/jobs", opt=_OPT)
async def create_job(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """Queue a job in llmq's internal request shape; always answers 202 with the job id. A webhook
    whose destination ``LLMQ_WEBHOOK_ALLOW`` refuses is a 400 before anything is queued (the
    delivery checks again, after its own lookup)."""
    req = await decode_body(request, GenerationRequest)
    if any(image.stored for image in req.images):
        # Images are stored by content hash for every tenant alike: a client naming a hash would
        # reach an image another tenant sent. Only llmq's own records carry references.
        raise InvalidRequest("an image is sent by its `url` or `data`: a client cannot name a stored image's "
                             "`sha256`", param="messages")
    # Without a secret every webhook is refused further on, so no lookup is made on a client's behalf.
    if req.webhook and svc.settings.webhook_secret:
        try:
            await check_url(policy(svc.settings.webhook_allow), req.webhook)
        except Refused as exc:
            raise InvalidRequest(f"webhook destination refused: {exc.message}", param="webhook") from None
    return await jobs.accepted(svc, ctx, [req])


@documented("A job's status and result", "jobs", errors=(404, 503), answer=JobView | GroupView, error=_ERROR)
@get("/v1/jobs/{job_id:str}", opt=_OPT)
async def get_job(svc: Svc, job: Job) -> Response:
    if isinstance(job.found, JobGroup):
        return json_response(await group_view(svc, job.found))
    record = await jobs.poll(svc, job)
    return json_response(job_view(record, await jobs.standing(svc, record)))


@documented("Cancel a job", "jobs", errors=(404, 503), answer=JobView | GroupView, error=_ERROR)
@delete("/v1/jobs/{job_id:str}", opt=_OPT, status_code=200)
async def cancel_job(svc: Svc, job: Job) -> Response:
    """Cancel wherever the job is: flagged if queued, aborted on its worker if running."""
    match await jobs.cancel(svc, job):
        case JobGroup() as group:
            return json_response(await group_view(svc, group))
        case JobRecord() as record:
            return json_response(job_view(record))


@documented("A job's events as SSE, resumable", "jobs", ok={200: (SSE,)}, errors=(400, 404, 503),
            headers=("Last-Event-ID",), query=("after",), error=_ERROR)
@get("/v1/jobs/{job_id:str}/events", opt=_OPT)
async def job_events(request: Request, svc: Svc, job: Job) -> Response:
    """The job's events as SSE, ``id:`` = sequence number; resumes after ``Last-Event-ID``.
    It reads the log first, then live events, so it works for finished and running jobs alike."""
    last_event_id = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    # A stream entry id's range: Redis would refuse anything past it mid-stream.
    after = whole_number(last_event_id, "Last-Event-ID", 0, 2**63 - 1, "Last-Event-ID must be an event sequence number")
    if isinstance(job.found, JobGroup):
        raise InvalidRequest(f"job {job.id} is a group of {len(job.found.jobs)} jobs: read each one's events at "
                             f"/v1/jobs/<id>/events, for ids in {job.found.jobs}", param="job_id")
    return EventStream(await jobs.events(svc, job.model, job.found, after=after), llmq_jobs.EventLog())


ROUTES = [create_job, get_job, cancel_job, job_events]
