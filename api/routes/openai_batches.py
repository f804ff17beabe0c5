"""OpenAI's Files and Batches routes, for offline batches (``client.files``, ``client.batches``).

``POST /v1/files`` (multipart, ``purpose=batch``) stores a JSONL file in Redis; ``POST
/v1/batches`` validates it into translated requests (api/batch_input.py) and records the batch;
the housekeeping process runs it (workers/housekeeping/batches.py) and leaves the output and error files as
outcomes, which this process renders on their first read (api/batch_output.py). Files and
batches belong to the API key that created them, as jobs do: another key gets 404.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath

from api.batch_input import read_lines
from api.batch_output import rendered
from api.context import Ctx, RequestContext
from api.http import decode_body, json_response
from api.operations import OPENAI_ERROR, documented
from api.query import query_int
from api.services import Services, Svc
from shared.batches import (
    ENDPOINTS,
    RESULTS,
    BatchCreate,
    BatchErrors,
    BatchList,
    BatchObject,
    BatchStore,
    FileDeleted,
    FileList,
    FileObject,
    RequestCounts,
)
from shared.errors import InvalidRequest, JobNotFound

__all__ = ["ROUTES"]

OPENAI = {"dialect": "openai_completions"}  # errors in OpenAI's shape
WINDOW_S = 24 * 3600  # the one completion window OpenAI offers
MAX_LIMIT = 100  # a batch list's page, at most (OpenAI's)


def _store(svc: Services) -> BatchStore:
    return BatchStore(svc.queue.redis, svc.keys)


def _mine(ctx: RequestContext, owner: str) -> bool:
    return owner == ctx.owner


async def _file(svc: Services, ctx: RequestContext, file_id: str) -> FileObject:
    found = await _store(svc).get_file(file_id)
    # A Message Batch's results are Anthropic's (api/routes/anthropic_batches.py), not a File here.
    if found is None or not _mine(ctx, found[1]) or found[0].purpose == RESULTS:
        raise JobNotFound(f"No such File object: {file_id}")
    return found[0]


async def _batch(svc: Services, ctx: RequestContext, batch_id: str) -> BatchObject:
    found = await _store(svc).get(batch_id)
    # A Message Batch is Anthropic's (api/routes/anthropic_batches.py), not a Batch here.
    if found is None or not _mine(ctx, found[1]) or found[0].endpoint not in ENDPOINTS:
        raise JobNotFound(f"No such Batch object: {batch_id}")
    return found[0]


@documented("Upload a batch input file (JSONL; purpose=batch)", "batches", body="file_upload",
            body_media="multipart/form-data", queues=False, errors=(400, 503), answer=FileObject, error=OPENAI_ERROR)
@post("/v1/files", opt=OPENAI, status_code=200)
async def upload_file(request: Request, svc: Svc, ctx: Ctx) -> Response:
    form = await request.form()
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise InvalidRequest("purpose must be 'batch' (the only file purpose llmq serves)", param="purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("a multipart 'file' field is required", param="file")
    content = await upload.read()
    meta = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=int(time.time()),
                      filename=upload.filename or "upload.jsonl", purpose="batch")
    await _store(svc).put_file(meta, content, ctx.owner)
    return json_response(meta)


@documented("Files", "batches", errors=(503,), answer=FileList, error=OPENAI_ERROR)
@get("/v1/files", opt=OPENAI)
async def list_files(svc: Svc, ctx: Ctx) -> Response:
    store = _store(svc)
    files = [await rendered(store, meta) for meta, owner in await store.list_files()
             if _mine(ctx, owner) and meta.purpose != RESULTS]
    return json_response(FileList(data=files))


@documented("A file", "batches", errors=(404, 503), answer=FileObject, error=OPENAI_ERROR)
@get("/v1/files/{file_id:str}", opt=OPENAI)
async def get_file(svc: Svc, ctx: Ctx, file_id: FromPath[str]) -> Response:
    return json_response(await rendered(_store(svc), await _file(svc, ctx, file_id)))


@documented("A file's content (input, output or error JSONL)", "batches", ok={200: ("application/octet-stream",)},
            errors=(404, 503), error=OPENAI_ERROR)
@get("/v1/files/{file_id:str}/content", opt=OPENAI)
async def file_content(svc: Svc, ctx: Ctx, file_id: FromPath[str]) -> Response:
    await rendered(_store(svc), await _file(svc, ctx, file_id))
    content = await _store(svc).file_content(file_id)
    return Response(content or b"", media_type="application/octet-stream")


@documented("Delete a file", "batches", errors=(404, 503), answer=FileDeleted, error=OPENAI_ERROR)
@delete("/v1/files/{file_id:str}", opt=OPENAI, status_code=200)
async def delete_file(svc: Svc, ctx: Ctx, file_id: FromPath[str]) -> Response:
    await _file(svc, ctx, file_id)
    await _store(svc).delete_file(file_id)
    return json_response(FileDeleted(id=file_id))


@documented("Create a batch from an uploaded file", "batches", body="batch",
            examples=({"input_file_id": "file-abc", "endpoint": "/v1/chat/completions", "completion_window": "24h"},),
            errors=(400, 404, 503), answer=BatchObject, error=OPENAI_ERROR)
@post("/v1/batches", opt=OPENAI, status_code=200)
async def create_batch(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, BatchCreate)
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if body.completion_window != "24h":
        raise InvalidRequest("completion_window must be '24h'", param="completion_window")
    meta = await _file(svc, ctx, body.input_file_id)
    if meta.purpose != "batch":
        raise InvalidRequest(f"file {meta.id} was not uploaded with purpose 'batch'", param="input_file_id")
    content = await _store(svc).file_content(meta.id) or b""
    lines, errors = await read_lines(svc, ctx, content, body.endpoint)
    now = int(time.time())
    batch = BatchObject(id=f"batch_{uuid.uuid4().hex}", endpoint=body.endpoint, input_file_id=meta.id,
                        completion_window=body.completion_window, created_at=now, expires_at=now + WINDOW_S,
                        metadata=body.metadata, status="in_progress", in_progress_at=now,
                        request_counts=RequestCounts(total=len(lines)))
    if errors:  # a malformed file fails the whole batch up front, as OpenAI's validation does
        batch = msgspec.structs.replace(batch, status="failed", in_progress_at=None, failed_at=now,
                                        errors=BatchErrors(data=errors), request_counts=RequestCounts())
        lines = []
    await _store(svc).create(batch, lines, ctx.owner)
    return json_response(batch)


@documented("A batch: status, request_counts, output and error files", "batches", errors=(404, 503),
            answer=BatchObject, error=OPENAI_ERROR)
@get("/v1/batches/{batch_id:str}", opt=OPENAI)
async def get_batch(svc: Svc, ctx: Ctx, batch_id: FromPath[str]) -> Response:
    return json_response(await _batch(svc, ctx, batch_id))


@documented("Cancel a batch", "batches", errors=(400, 404, 503), answer=BatchObject, error=OPENAI_ERROR)
@post("/v1/batches/{batch_id:str}/cancel", opt=OPENAI, status_code=200)
async def cancel_batch(svc: Svc, ctx: Ctx, batch_id: FromPath[str]) -> Response:
    """In-flight requests are cancelled and the rest never start; the batch ends ``cancelled``
    with what completed in its output file (housekeeping does that within a second or two)."""
    batch = await _batch(svc, ctx, batch_id)
    if not await _store(svc).transition(batch_id, ("validating", "in_progress"), "cancelling", int(time.time())):
        if batch.status not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"Cannot cancel a batch with status {batch.status!r}.")
    return json_response(await _batch(svc, ctx, batch_id))


@documented("Batches, newest first", "batches", errors=(400, 503), query=("limit", "batch_after"), answer=BatchList,
            error=OPENAI_ERROR)
@get("/v1/batches", opt=OPENAI)
async def list_batches(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """The caller's own batches, newest first; ``after`` (a batch id) pages on, ``limit`` is 1-100
    (20 unless given), as OpenAI's."""
    limit = query_int(request, "limit", 20, 1, MAX_LIMIT)
    data, more = await _store(svc).list(ctx.owner, request.query_params.get("after"), limit)
    return json_response(BatchList(data=data, first_id=data[0].id if data else None,
                                   last_id=data[-1].id if data else None, has_more=more))


ROUTES = [upload_file, list_files, get_file, file_content, delete_file, create_batch, get_batch, cancel_batch,
          list_batches]
