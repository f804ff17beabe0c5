"""The request path every route takes: a route decodes its body, translates it, and calls this.

- :func:`respond`: queue the request's jobs and answer: 202 with a job to poll (``Prefer:
  respond-async``), the whole answer once every job is done, or a stream of their events, each
  rendered in the route's dialect.
- :func:`enqueue`: queue without following (fire and poll; a background response).
- :func:`submit`: one job and its events, for a route that drives its own stream (LMTP's socket).
- :func:`poll`, :func:`record`, :func:`standing`, :func:`events`, :func:`cancel`, :func:`delete`: a
  job already queued, as a poll sees it: its record (ended here once overdue), where it stands
  while it waits, its events from the log then live, its end.

The mechanics underneath are :mod:`api.submit` (admission, enqueue, subscription),
:mod:`api.fanout` (one request, several jobs) and :mod:`api.follow` (ordering, gaps, deadlines).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import msgspec
from litestar import Response

from api import dialects
from api.context import JobRef, RequestContext
from api.dialects.stream import StreamRenderer
from api.fanout import collect_all, enqueue_all, merge, submit_all
from api.follow import DEADLINE_GRACE_MS, Events
from api.http import EventStream, json_response
from api.services import Services
from api.submit import Submission, follow_job, submit, subscribe_job
from shared.errors import JobNotFound
from shared.events import Done, Event, Tokens
from shared.queue import now_ms
from shared.schemas import TERMINAL_STATUSES, GenerationRequest, JobGroup, JobRecord, JobResult
from shared.slo import Standing

__all__ = ["Queued", "Accepted", "Submission", "respond", "accepted", "enqueue", "submit", "poll", "record", "standing",
           "standing_of", "events", "cancel", "delete"]


@dataclass(frozen=True, slots=True)
class Queued:
    """What a client request queued: its jobs' requests as queued (the model filled in), and the
    id and creation time (epoch seconds) its answer is named by (its first job's)."""

    requests: list[GenerationRequest]
    job_id: str
    created: int

    @property
    def request(self) -> GenerationRequest:
        return self.requests[0]


Whole = Callable[[Queued, list[JobResult]], object]
"""The whole answer from every job's result: a body (sent as JSON) or a ready Response."""
Renderer = Callable[[Queued], StreamRenderer[bytes]]
"""The stream's renderer, once the jobs are queued."""


class Accepted(msgspec.Struct, kw_only=True):
    """The 202 of ``Prefer: respond-async`` and ``POST /v1/jobs``: where to poll."""

    id: str
    status: str = "queued"
    url: str


async def respond(svc: Services, ctx: RequestContext, reqs: GenerationRequest | list[GenerationRequest], *,
                  stream: bool, whole: Whole | None = None, renderer: Renderer | None = None,
                  seen: Callable[[Tokens | Done], None] | None = None) -> Response:
    """Answer a request that queues ``reqs`` (one job each). ``whole`` and ``renderer`` default to
    the dialect's own, from the queued requests alone (:mod:`api.dialects`); ``seen`` sees each
    token event of a whole answer as it is folded (TGI keeps its tokens so)."""
    many = reqs if isinstance(reqs, list) else [reqs]
    if ctx.respond_async:
        return await accepted(svc, ctx, many)
    subs = await submit_all(svc, ctx, many, keepalive=stream)
    queued = Queued([s.request for s in subs], subs[0].job_id, subs[0].created)
    if not stream:
        results = await collect_all(subs, seen)
        answer = whole(queued, results) if whole is not None else _whole(queued, results)
        return answer if isinstance(answer, Response) else json_response(answer)
    render = renderer(queued) if renderer is not None else dialects.stream(queued.request, queued.job_id,
                                                                           queued.created)
    # Held until the first event: an error that comes first still gets its HTTP status.
    return EventStream(merge(subs, many[0].sampling.n), render, svc.settings.sse_keepalive_s)


def _whole(queued: Queued, results: list[JobResult]) -> object:
    if len(results) == 1:
        return dialects.render_result(queued.request, results[0], queued.job_id, queued.created)
    return dialects.render_group_result(queued.requests, results, queued.job_id, queued.created)


async def accepted(svc: Services, ctx: RequestContext, reqs: list[GenerationRequest]) -> Response:
    """202 with the id to poll at ``Location``; a request that queues several jobs (a list of
    prompts) gets one id for all of them."""
    job_id = await enqueue(svc, ctx, reqs)
    location = f"/v1/jobs/{job_id}"
    return json_response(Accepted(id=job_id, url=location), 202, headers={"Location": location})


async def enqueue(svc: Services, ctx: RequestContext, reqs: GenerationRequest | list[GenerationRequest]) -> str:
    """Queue without following: the jobs outlive the request. Returns the job's id (or with
    several jobs their group's)."""
    return await enqueue_all(svc, ctx, reqs if isinstance(reqs, list) else [reqs])


async def poll(svc: Services, job: JobRef) -> JobRecord:
    """The job's record now. Nobody may be waiting on a fire-and-poll job, so the poll that finds
    it past its deadline ends it (fenced: its worker, if any, writes nothing more)."""
    record = job.found
    assert isinstance(record, JobRecord)
    if record.status not in TERMINAL_STATUSES and record.deadline is not None and now_ms() >= record.deadline:
        if await svc.queue.expire(job.model, job.id, grace_ms=DEADLINE_GRACE_MS):
            return await _reread(svc, job)
    return record


async def standing(svc: Services, record: JobRecord) -> Standing | None:
    """Where a queued job stands in its model's queue (one script call); None for any other."""
    return await standing_of(svc, record.model, record.id) if record.status == "queued" else None


async def standing_of(svc: Services, model: str, job_id: str) -> Standing | None:
    """Where a job of ``model`` stands, against the model's warm capacity (None: it does not wait)."""
    return await svc.queue.position(model, job_id, await svc.models.capacity(model))


async def events(svc: Services, model: str, record: JobRecord, *, after: int = 0) -> Events:
    """The job's events numbered above ``after``: a finished job's from its log alone (nothing is
    subscribed, and a stream resumed after its last event ends at once), else the log, then live
    until the terminal event."""
    if record.status in TERMINAL_STATUSES:
        return _replay(await svc.queue.read_events(model, record.id, after))
    live = await subscribe_job(svc, model, record.id, AsyncExitStack())
    return follow_job(svc, live, after_seq=after, backfill=True, keepalive=True, deadline=record.deadline)


async def _replay(logged: list[Event]) -> AsyncGenerator[Event, None]:
    for event in logged:
        yield event


async def cancel(svc: Services, job: JobRef) -> JobRecord | JobGroup:
    """Cancel wherever the job is: flagged if queued, aborted on its worker if running; a group,
    each of its jobs. Returns the record as it is now (a group: the group)."""
    match job.found:
        case JobGroup() as group:
            for member in group.jobs:
                await svc.queue.cancel(group.model, member)
            return group
        case _:
            if await svc.queue.cancel(job.model, job.id) is None:
                raise JobNotFound(f"job {job.id} not found")
            return await _reread(svc, job)


async def delete(svc: Services, job: JobRef) -> None:
    """End the job if it still runs and forget it: every later read is a 404."""
    if not await svc.queue.delete(job.model, job.id):
        raise JobNotFound(f"job {job.id} not found")


async def record(svc: Services, model: str, job_id: str) -> JobRecord:
    """The job's record as it is now; a job gone (its record expired) is not found."""
    found = await svc.queue.get_job(model, job_id)
    if found is None:
        raise JobNotFound(f"job {job_id} not found")
    return found


async def _reread(svc: Services, job: JobRef) -> JobRecord:
    return await record(svc, job.model, job.id)  # (it may have expired since it was found)

