"""Anthropic's Message Batches: ``/v1/messages/batches`` (``client.messages.batches``).

A create validates and translates every request (api/dialects/anthropic_batches.py) and records
a batch of endpoint ``/v1/messages`` in the one batch store (shared/batches.py); the housekeeping
process runs it as it runs OpenAI's batches (workers/housekeeping/batches.py). Its results are its two
produced files, rendered as Anthropic's result lines on their first read (api/batch_output.py):
the succeeded lines, then the others, each in request order (Anthropic promises no order: the
``custom_id`` matches a result to its request). Batches belong to the API key that created them:
another key gets 404, as for every job.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from api.batch_output import rendered
from api.context import Ctx, RequestContext
from api.dialects import anthropic_batches as ab
from api.dialects import anthropic_messages as am
from api.http import decode_body, json_response
from api.operations import documented
from api.query import query_int
from api.services import Services, Svc
from api.submit import admit
from shared.batches import MESSAGES, BatchObject, BatchStore, RequestCounts, StoredLine
from shared.errors import InvalidRequest, JobNotFound, ServiceError

__all__ = ["ROUTES"]

_OPT = {"dialect": am.NAME}  # errors in Anthropic's shape
YIELD_EVERY = 256  # requests translated between yields to the event loop (a batch has up to 100,000)
MAX_LIMIT = 1000


def _store(svc: Services) -> BatchStore:
    return BatchStore(svc.queue.redis, svc.keys)


async def _batch(svc: Services, ctx: RequestContext, batch_id: str) -> BatchObject:
    found = await _store(svc).get(batch_id)
    # An OpenAI batch is not a Message Batch: the same 404 as an unknown id.
    if found is None or found[1] != ctx.owner or found[0].endpoint != MESSAGES:
        raise JobNotFound(f"No such Message Batch: {batch_id}")
    return found[0]


async def _content(store: BatchStore, file_id: str | None) -> bytes:
    if not file_id:
        return b""
    got = await store.get_file(file_id)
    if got is None:
        return b""
    await rendered(store, got[0])
    return await store.file_content(file_id) or b""


async def _render(svc: Services, batch: BatchObject) -> ab.MessageBatch:
    """The object; an ended batch's counts split its error file's lines by result type."""
    errors: Counter[str] = Counter()
    if ab.ended(batch) and batch.request_counts.failed:
        errors = ab.tally(await _content(_store(svc), batch.error_file_id))
    return ab.render_batch(batch, errors)


async def _line(svc: Services, ctx: RequestContext, request: ab.BatchRequest) -> StoredLine:
    try:
        req = await admit(svc, ctx, ab.translate(request))
    except ServiceError as exc:  # errored in the results; the rest of the batch runs
        return StoredLine(custom_id=request.custom_id, error=ab.refusal(exc))
    return StoredLine(custom_id=request.custom_id, requests=[req])


@documented("Create a Message Batch", "anthropic", body="message_batch",
            examples=({"requests": [{"custom_id": "a", "params": {"model": "tiny-llama", "max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "Hi"}]}}]},),
            errors=(400, 503), answer=ab.MessageBatch, error=am.ErrorResponse)
@post("/v1/messages/batches", opt=_OPT, status_code=200)
async def create_batch(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, ab.CreateBatch)
    ab.check(body)
    lines = []
    for number, req in enumerate(body.requests, start=1):
        if number % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # this process relays streams meanwhile
        lines.append(await _line(svc, ctx, req))
    now = int(time.time())
    batch = BatchObject(id=f"{ab.ID_PREFIX}{uuid.uuid4().hex}", endpoint=MESSAGES, input_file_id="",
                        completion_window="24h", created_at=now, expires_at=now + ab.WINDOW_S, status="in_progress",
                        in_progress_at=now, request_counts=RequestCounts(total=len(lines)))
    await _store(svc).create(batch, lines, ctx.owner)
    return json_response(ab.render_batch(batch))


@documented("A Message Batch", "anthropic", errors=(404, 503), answer=ab.MessageBatch, error=am.ErrorResponse)
@get("/v1/messages/batches/{message_batch_id:str}", opt=_OPT)
async def get_batch(svc: Svc, ctx: Ctx, message_batch_id: FromPath[str]) -> Response:
    return json_response(await _render(svc, await _batch(svc, ctx, message_batch_id)))


@documented("Message Batches, newest first", "anthropic", errors=(400, 503),
            query=("message_batch_limit", "after_id", "before_id"), answer=ab.BatchPage, error=am.ErrorResponse)
@get("/v1/messages/batches", opt=_OPT)
async def list_batches(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """The caller's own Message Batches, newest first; ``after_id`` pages on, ``limit`` is 1-1000
    (20 unless given). ``before_id`` (paging back) is refused: the store pages one way only."""
    query = request.query_params
    if query.get("before_id") is not None:
        raise InvalidRequest("before_id is not supported by this server; page with after_id", param="before_id")
    limit = query_int(request, "limit", 20, 1, MAX_LIMIT)
    found, more = await _store(svc).list(ctx.owner, query.get("after_id"), limit, endpoints=(MESSAGES,))
    data = [await _render(svc, batch) for batch in found]
    return json_response(ab.BatchPage(data=data, has_more=more, first_id=data[0].id if data else None,
                                      last_id=data[-1].id if data else None))


@documented("Cancel a Message Batch", "anthropic", errors=(400, 404, 503), answer=ab.MessageBatch,
            error=am.ErrorResponse)
@post("/v1/messages/batches/{message_batch_id:str}/cancel", opt=_OPT, status_code=200)
async def cancel_batch(svc: Svc, ctx: Ctx, message_batch_id: FromPath[str]) -> Response:
    """Running requests are cancelled and the rest never start (``canceled`` results); the batch
    is ``canceling`` until housekeeping ends it, within a second or two."""
    batch = await _batch(svc, ctx, message_batch_id)
    if not await _store(svc).transition(batch.id, ("validating", "in_progress"), "cancelling", int(time.time())):
        if batch.status not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"Cannot cancel a Message Batch that has {ab.render_batch(batch).processing_status}.")
    return json_response(await _render(svc, await _batch(svc, ctx, message_batch_id)))


@documented("Delete an ended Message Batch", "anthropic", errors=(400, 404, 503), answer=ab.DeletedBatch,
            error=am.ErrorResponse)
@delete("/v1/messages/batches/{message_batch_id:str}", opt=_OPT, status_code=200)
async def delete_batch(svc: Svc, ctx: Ctx, message_batch_id: FromPath[str]) -> Response:
    """Only an ended batch, with its results (as Anthropic: cancel a running one first)."""
    batch = await _batch(svc, ctx, message_batch_id)
    if not ab.ended(batch):
        raise InvalidRequest("A Message Batch can be deleted only once its processing ended; cancel it first.")
    await _store(svc).delete(batch)
    return json_response(ab.DeletedBatch(id=batch.id))


@documented("An ended Message Batch's results (JSONL)", "anthropic", ok={200: ("application/x-jsonl",)},
            errors=(400, 404, 503), error=am.ErrorResponse)
@get("/v1/messages/batches/{message_batch_id:str}/results", opt=_OPT)
async def batch_results(svc: Svc, ctx: Ctx, message_batch_id: FromPath[str]) -> Response:
    batch = await _batch(svc, ctx, message_batch_id)
    if not ab.ended(batch):
        raise InvalidRequest(f"Message Batch {batch.id} has not ended: its results are not ready.")
    store = _store(svc)
    content = await _content(store, batch.output_file_id) + await _content(store, batch.error_file_id)
    return Response(content, media_type="application/x-jsonl")


ROUTES = [create_batch, get_batch, list_batches, cancel_batch, delete_batch, batch_results]
