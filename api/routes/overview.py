"""The deployment as JSON, for the console (docs/console.md) and for scripts.

``GET /v1/access`` (who the caller is), ``/v1/deployment`` (models, workers, queues, history),
``/v1/tenants``, ``GET /v1/jobs`` (recent jobs, filtered), ``/v1/jobs/{id}/record`` (one job's
record, its attempts), ``/v1/dead_letters`` and, for operators, their requeue and discard.

Who sees what (api/auth.py, :class:`~api.auth.Viewer`): an operator key sees everything; any
other key only its own jobs, dead letters and tenant; with no keys configured, loopback callers
are operators and others get 403. The deployment's figures (queues, workers) are no one's data
and show to every caller, as /metrics does. No list shows a prompt or an output: only a job's
record does, to its owner and operators.
"""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath

from api.auth import Viewer, viewer
from api.context import Ctx, Job
from api.dialects.jobs import ErrorBody
from api.http import json_response
from api.jobs import standing, standing_of
from api.media import admit_images
from api.operations import documented
from api.query import query_int
from api.services import Services, Svc
from api.views import (
    AccessView,
    DeadLetterDeleted,
    DeadLetterList,
    DeploymentView,
    JobList,
    LevelView,
    ModelView,
    RecordView,
    RequeueView,
    TenantList,
)
from shared import browse
from shared.admission import new_job
from shared.errors import Forbidden, InvalidRequest, JobNotFound
from shared.media import default_timeout_s
from shared.schemas import GROUP_PREFIX, JobGroup, JobRecord, JobStatus
from shared.status import snapshot

__all__ = ["ROUTES"]

_OPT = {"dialect": "jobs"}
_STATUSES = frozenset(JobStatus.__args__)  # type: ignore[attr-defined]
_MAX_LIST = 500
_STANDINGS = 20
"""At most this many queued jobs of a ``GET /v1/jobs`` page are given their queue position and ETA."""


def _viewer(connection: ASGIConnection, svc: Services) -> Viewer:
    return viewer(connection, svc.operators, svc.keys_on)


def _viewer_first(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A route guard: the viewer rule (:func:`_viewer`) before the route's dependencies run, so a
    caller it refuses gets the 403 GET /v1/jobs gives, whether or not the job it names exists."""
    _viewer(connection, connection.app.state.services)


def _operator(request: Request, svc: Svc, action: str) -> Viewer:
    who = _viewer(request, svc)
    if not who.operator:
        raise Forbidden(f"Only an operator key may {action} (LLMQ_OPERATOR_KEYS)")
    return who


@documented("Who the caller is: an operator, or a tenant seeing its own", "console", errors=(403, 503),
            answer=AccessView, error=ErrorBody)
@get("/v1/access", opt=_OPT)
async def access(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """The caller's role: ``operator`` or ``tenant`` (its own jobs only), and its tenant."""
    who = _viewer(request, svc)
    return json_response(AccessView(role="operator" if who.operator else "tenant", tenant=ctx.tenant,
                                    keys=svc.keys_on))


@documented("Models, workers, slots, adapters; each level's queue and history", "console", errors=(403, 503),
            answer=DeploymentView, error=ErrorBody)
@get("/v1/deployment", opt=_OPT)
async def deployment(request: Request, svc: Svc) -> Response:
    """Every known model: its workers (warm and loading), slots, adapters, each priority level's
    waiting and running jobs, oldest age and throughput, and the last ten minutes' samples. A
    tenant's key sees only the adapters it may use (a private one of another key's is no model to
    it), of those the workers' engines hold."""
    who = _viewer(request, svc)
    redis, keys = svc.queue.redis, svc.keys
    status = await snapshot(redis, keys, top=0, held=False, models=list(await svc.models.known()))
    shown = None if who.operator else {a.name for a in await svc.models.visible_adapters(who)}
    # The workers' own Prometheus samples are /metrics' to show.
    workers = [msgspec.structs.replace(w, metrics=[], adapters=w.adapters if shown is None else
                                       [a for a in w.adapters if a in shown]) for w in status.workers]
    models = []
    for m in status.models:
        mine = [w for w in workers if w.model == m.name]
        rates = await browse.throughput(redis, keys, m.name, status.at)
        models.append(ModelView(
            name=m.name, kind=m.kind, ready_workers=m.ready_workers,
            loading_workers=sum(w.status == "warming" for w in mine),
            slots=sum(w.slots for w in mine if w.status == "ready"),
            slots_in_use=sum(w.running for w in mine), waiting=m.waiting, running=m.running,
            dead_letters=m.dead_letters, adapters=sorted({a for w in mine for a in w.adapters}),
            levels=[LevelView(level=lv.level, waiting=lv.waiting, running=lv.running, oldest_age_s=lv.oldest_age_s,
                              finished_per_min=rates[lv.level]) for lv in m.levels],
            history=await browse.history(redis, keys, m.name, status.at)))
    return json_response(DeploymentView(at=status.at, models=models, workers=workers))


@documented("Tenants: weight, share, running and waiting, limits, today's usage", "console", errors=(403, 503),
            answer=TenantList, error=ErrorBody)
@get("/v1/tenants", opt=_OPT)
async def tenants(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """Each tenant on each model: weight and fair share against its share of the last minute's
    tokens, running and waiting jobs, limits and today's usage. A tenant's key: its own rows."""
    who = _viewer(request, svc)
    # Everyone's rows, read at most once a second by this process (every open console polls
    # this), then cut to what this caller may see: the cache holds no one caller's view.
    cache: browse.TenantRows = request.app.state.setdefault("tenant_rows", browse.TenantRows())
    rows = await cache.get(svc.queue.redis, svc.keys, await svc.models.known())
    return json_response(TenantList(data=rows if who.operator else [r for r in rows if r.tenant == ctx.tenant]))


def _query(request: Request, name: str, allowed: frozenset[str] | None = None) -> str | None:
    value = request.query_params.get(name) or None
    if value is not None and allowed is not None and value not in allowed:
        raise InvalidRequest(f"{name} must be one of {', '.join(sorted(allowed))}", param=name)
    return value


@documented("Recent jobs, newest first, filtered; no prompt or output", "jobs", errors=(400, 403, 503),
            query=("list_model", "list_tenant", "list_status", "list_dialect", "list_limit"), answer=JobList,
            error=ErrorBody)
@get("/v1/jobs", opt=_OPT)
async def list_jobs(request: Request, svc: Svc) -> Response:
    """Recent jobs, newest first: ``model``, ``tenant``, ``status``, ``dialect`` filter, ``limit``
    (1-500, 50 unless given) cuts. A tenant's key sees its own only."""
    who = _viewer(request, svc)
    known = await svc.models.known()
    model = _query(request, "model", frozenset(known))
    limit = query_int(request, "limit", 50, 1, _MAX_LIST)
    jobs = await browse.recent_jobs(svc.queue.redis, svc.keys, [model] if model else known, owner=who.only,
                                    limit=limit, tenant=_query(request, "tenant"),
                                    status=_query(request, "status", _STATUSES), dialect=_query(request, "dialect"))
    # Where the waiting ones stand: one script call each, so only the first few of the page.
    waiting = [j for j in jobs if j.status == "queued"][:_STANDINGS]
    for job, stands in zip(waiting, await asyncio.gather(*(standing_of(svc, j.model, j.id) for j in waiting)),
                           strict=True):
        if stands is not None:
            job.queue_position, job.eta_s = stands.position, stands.eta_s
    return json_response(JobList(data=jobs))


@documented("A job's record: request, result, every attempt's worker", "jobs", errors=(400, 403, 404, 503),
            answer=RecordView, error=ErrorBody)
@get("/v1/jobs/{job_id:str}/record", opt=_OPT, guards=[_viewer_first])
async def job_record(svc: Svc, job: Job) -> Response:
    """One job's record, its request and result included: to its owner and operators only (the
    ``job`` dependency's check), with every attempt's worker and start; to a caller GET /v1/jobs
    refuses (with no keys, one not on loopback), a 403 as there."""
    if isinstance(job.found, JobGroup):
        raise InvalidRequest(f"job {job.id} is a group: read each of {job.found.jobs}", param="job_id")
    [record] = await svc.queue.get_jobs(job.model, [job.id])  # its end settled, if logged (get_jobs)
    record = record or job.found
    return json_response(RecordView.of(record, await standing(svc, record)))


@documented("Jobs that failed too many deliveries, newest first", "console", errors=(400, 403, 503),
            query=("list_model",), answer=DeadLetterList, error=ErrorBody)
@get("/v1/dead_letters", opt=_OPT)
async def list_dead_letters(request: Request, svc: Svc) -> Response:
    """Jobs that failed too many deliveries, newest first (``model`` filters); a tenant's key
    sees its own."""
    who = _viewer(request, svc)
    known = await svc.models.known()
    model = _query(request, "model", frozenset(known))
    data = await browse.dead_letters(svc.queue.redis, svc.keys, [model] if model else known, owner=who.only)
    return json_response(DeadLetterList(data=data))


async def _dead(svc: Svc, job_id: str) -> tuple[str, bytes, dict[bytes, bytes], JobRecord]:
    """The model, dead-letter entry (id, fields) and record of a dead-lettered job; 404 if none."""
    for model in [] if job_id.startswith(GROUP_PREFIX) else await svc.models.known():  # a group is never one
        found = await browse.find_dead_letter(svc.queue.redis, svc.keys, model, job_id)
        if found is not None and (record := await svc.queue.get_job(model, job_id)) is not None:
            return model, *found, record
    raise JobNotFound(f"job {job_id} is not a dead letter")


@documented("Queue a dead letter again as a new job (operators)", "console", errors=(403, 404, 429, 503),
            answer=RequeueView, error=ErrorBody)
@post("/v1/dead_letters/{job_id:str}/requeue", opt=_OPT, status_code=200)
async def requeue(request: Request, svc: Svc, job_id: FromPath[str]) -> Response:
    """Queue a dead letter's request again as a new job (a new id, the same key and tenant), and
    take it off the dead letters. Operators only."""
    _operator(request, svc, "requeue a dead letter")
    model, entry, fields, old = await _dead(svc, job_id)
    # Its images renewed to its new deadline (a 400 if one is gone: the client must send it again).
    req = await admit_images(svc.media, old.request)
    # Taken off first, so two operators clicking at once queue it once; put back if it cannot be queued.
    if not await browse.discard_dead_letter(svc.queue.redis, svc.keys, model, entry):
        raise JobNotFound(f"job {job_id} is not a dead letter")
    tenant = old.tenant_of()
    default = default_timeout_s(req, svc.settings.deadline_s, svc.settings.media_ttl_s)
    record = new_job(req, owner=old.owner, default_timeout_s=default, tenant=tenant,
                     max_model_len=svc.settings.max_model_len)
    try:
        new_id = await svc.queue.enqueue(record, max_queued=svc.settings.max_queued,
                                         tenant=await svc.tenants.get(tenant))
    except BaseException:
        await browse.restore_dead_letter(svc.queue.redis, svc.keys, model, fields)
        raise
    return json_response(RequeueView(job_id=job_id, requeued_as=new_id))


@documented("Discard a dead letter (operators)", "console", errors=(403, 404, 503), answer=DeadLetterDeleted,
            error=ErrorBody)
@delete("/v1/dead_letters/{job_id:str}", opt=_OPT, status_code=200)
async def discard(request: Request, svc: Svc, job_id: FromPath[str]) -> Response:
    """Take a dead letter off the list for good (its record stays until its TTL). Operators only."""
    _operator(request, svc, "discard a dead letter")
    model, entry, _, _ = await _dead(svc, job_id)
    if not await browse.discard_dead_letter(svc.queue.redis, svc.keys, model, entry):
        raise JobNotFound(f"job {job_id} is not a dead letter")
    return json_response(DeadLetterDeleted(job_id=job_id))


# The jobs' views first, then the console's: the order of the published document (api/openapi.py).
ROUTES = [list_jobs, job_record, access, deployment, tenants, list_dead_letters, requeue, discard]
