"""OpenAI Responses: ``POST /v1/responses`` and, for a response already made, ``GET`` (its object,
or its stream replayed after ``starting_after``), ``/cancel``, ``DELETE`` and ``/input_items``.

A response is one job (:mod:`api.dialects.openai_responses`): reading one back is reading the
job's record and event log, on any API process, as ``/v1/jobs/{id}`` does. ``background: true``
queues the job unwatched (it outlives the request); otherwise the job is the request's and ends
with it.
"""

from __future__ import annotations

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from api import jobs
from api.context import Ctx, JobRef, RequestContext, job_ref
from api.dialects import openai_responses as r
from api.dialects.stream import SSE
from api.http import EventStream, decode_body, json_response
from api.operations import ASYNC, ASYNC_HEADERS, JSON, OPENAI_ERRORS, documented
from api.query import query_int
from api.services import Svc
from shared.errors import InvalidRequest, JobNotFound
from shared.schemas import TERMINAL_STATUSES, ChatMessage, GenerationRequest, JobRecord

__all__ = ["ROUTES"]

DIALECT = {"dialect": r.NAME}


# A response is a job, read back from its record and event log.
@documented("OpenAI responses (background: queued at once)", "openai", body="responses",
            examples=({"input": "Hello", "max_output_tokens": 4},
                      {"input": "Hi", "max_output_tokens": 2, "stream": True},
                      {"input": "Hi", "max_output_tokens": 2, "background": True}),
            ok={200: (JSON, SSE), **ASYNC}, errors=OPENAI_ERRORS, headers=ASYNC_HEADERS, answer=r.Response,
            error=r.ErrorResponse)
@post("/v1/responses", opt=DIALECT, status_code=200)
async def create_response(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, r.ResponsesRequest)
    history = await _history(request, svc, body.previous_response_id) if body.previous_response_id else []
    req = r.to_generation_request(body, max_model_len=svc.settings.max_model_len, history=history)
    if body.background and not ctx.respond_async:
        return await _background(svc, ctx, body, req)
    # An error before the first event (say, a prompt too long for the model) keeps its HTTP status.
    return await jobs.respond(
        svc, ctx, req, stream=bool(body.stream),
        whole=lambda q, results: r.render_finished(r.echo_of_body(body, q.request.served_name), results[0], q.job_id,
                                                   q.created),
        renderer=lambda q: r.ResponseStream(r.echo_of_body(body, q.request.served_name), q.job_id, q.created))


async def _background(svc: Svc, ctx: RequestContext, body: r.ResponsesRequest, req: GenerationRequest) -> Response:
    """Queued and answered at once: ``queued``, or the stream of a job nobody's leaving cancels."""
    job_id = await jobs.enqueue(svc, ctx, req)
    model = await svc.models.resolve(req.model)
    try:
        record = await jobs.record(svc, model, job_id)
    except JobNotFound:  # expired already (a repeated Idempotency-Key of a long-gone job)
        raise JobNotFound(f"Response with id '{r.response_id(job_id)}' not found.") from None
    created = int(record.queued_at // 1000)
    echo = r.echo_of_body(body, model)
    if not body.stream:
        # Queued as it was accepted (a worker may have taken it since: the next poll says so); a
        # repeated Idempotency-Key that found a finished job answers with how it ended.
        if record.status in TERMINAL_STATUSES:
            return json_response(r.render_record(record, echo=echo))
        return json_response(r.render_response(echo, job_id, created, "queued"))
    return EventStream(await jobs.events(svc, model, record), r.ResponseStream(echo, job_id, created))


async def _found(request: Request, svc: Svc, response_id: str) -> JobRef:
    """The job behind a response id, checked to be a response (and the caller's, by ``job_ref``)."""
    job_id = r.job_id_of(response_id)
    try:
        if job_id is None:
            raise JobNotFound(response_id)
        job = await job_ref(job_id, request.scope, svc)
        if not isinstance(job.found, JobRecord) or job.found.request.dialect != r.NAME:
            raise JobNotFound(response_id)
    except JobNotFound:
        raise JobNotFound(f"Response with id '{response_id}' not found.") from None
    return job


async def _history(request: Request, svc: Svc, previous_id: str) -> list[ChatMessage]:
    """The conversation ``previous_response_id`` continues: that response's stored input and
    output, while its job is kept (LLMQ_RESULT_TTL_S) and it was stored (``store``)."""
    try:
        job = await _found(request, svc, previous_id)
    except JobNotFound:
        raise JobNotFound(f"Previous response with id '{previous_id}' not found (gone after LLMQ_RESULT_TTL_S, "
                          "or never stored).", param="previous_response_id") from None
    record = job.found
    assert isinstance(record, JobRecord)
    kept = record.request.output.reported
    if kept is not None and not kept.store:  # as OpenAI: a response made with store: false is not kept
        raise JobNotFound(f"Previous response with id '{previous_id}' not found: it was made with "
                          "store: false.", param="previous_response_id")
    if record.status != "done" or record.result is None:
        raise InvalidRequest(f"Previous response with id '{previous_id}' has not completed (it is "
                             f"{r.render_record(record).status}).", param="previous_response_id")
    return r.history_of(record.request, record.result)


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return value in ("true", "1")


@documented("A response; with stream=true its events after starting_after", "openai", ok={200: (JSON, SSE)},
            errors=(400, 404, 503), query=("stream", "starting_after"), answer=r.Response, error=r.ErrorResponse)
@get("/v1/responses/{response_id:str}", opt=DIALECT)
async def get_response(request: Request, svc: Svc, response_id: FromPath[str]) -> Response:
    """The response now; with ``stream=true`` its events numbered above ``starting_after``, from
    the job's event log, then live until it ends."""
    job = await _found(request, svc, response_id)
    if not _flag(request, "stream"):
        # As GET /v1/jobs/{id}: nobody may be waiting on a background job, so the poll ends it.
        return json_response(r.render_record(await jobs.poll(svc, job)))
    after = query_int(request, "starting_after", -1, -1, 2**63 - 1)
    record = job.found
    assert isinstance(record, JobRecord)
    echo = r.echo_of_request(record.request, background=True)
    renderer = r.ResponseStream(echo, job.id, int(record.queued_at // 1000), starting_after=after)
    return EventStream(await jobs.events(svc, job.model, record), renderer)


@documented("Cancel a response", "openai", errors=(404, 503), answer=r.Response, error=r.ErrorResponse)
@post("/v1/responses/{response_id:str}/cancel", opt=DIALECT, status_code=200)
async def cancel_response(request: Request, svc: Svc, response_id: FromPath[str]) -> Response:
    job = await _found(request, svc, response_id)
    try:
        record = await jobs.cancel(svc, job)
    except JobNotFound:
        raise JobNotFound(f"Response with id '{response_id}' not found.") from None
    assert isinstance(record, JobRecord)
    return json_response(r.render_record(record))


@documented("Delete a response (cancels it if it runs)", "openai", errors=(404, 503), answer=r.Deleted,
            error=r.ErrorResponse)
@delete("/v1/responses/{response_id:str}", opt=DIALECT, status_code=200)
async def delete_response(request: Request, svc: Svc, response_id: FromPath[str]) -> Response:
    """Ends the job if it still runs and forgets it: a later GET, resume or cancel is a 404."""
    job = await _found(request, svc, response_id)
    try:
        await jobs.delete(svc, job)
    except JobNotFound:
        raise JobNotFound(f"Response with id '{response_id}' not found.") from None
    return json_response(r.Deleted(id=response_id))


@documented("A response's input, as message items", "openai", errors=(404, 503), answer=r.ItemList,
            error=r.ErrorResponse)
@get("/v1/responses/{response_id:str}/input_items", opt=DIALECT)
async def input_items(request: Request, svc: Svc, response_id: FromPath[str]) -> Response:
    job = await _found(request, svc, response_id)
    assert isinstance(job.found, JobRecord)
    return json_response(r.render_input_items(job.found.request, job.id))


ROUTES = [create_response, get_response, cancel_response, delete_response, input_items]
