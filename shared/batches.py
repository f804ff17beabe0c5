"""Batch files in the OpenAI Batch API shape: the objects, and how they are kept in Redis.

The API stores an uploaded file, validates a batch's input file into translated lines and
answers the Files and Batches routes (api/routes/batches.py). The housekeeping process advances
each batch (workers/housekeeping/batches.py): it queues the lines as ordinary jobs at a bounded rate and
gathers each line's outcome (:data:`LineOutcome`: its results, or why it has none) into the
output and error files. Only the API speaks the endpoints' wire shapes, so those files hold
outcomes until the API first reads them; it renders them then (api/batch_output.py) and keeps
the rendered bytes. Both sides read and write through :class:`BatchStore`; everything is
readable with redis-cli (``HGETALL llmq:{batch_...}:batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis

from shared import scripts
from shared.codec import encode
from shared.keys import Keys
from shared.redis import reply
from shared.schemas import GenerationRequest, JobError, JobResult

__all__ = ["FileObject", "BatchCreate", "BatchObject", "BatchError", "RequestCounts", "InputLine", "StoredLine",
           "LineError", "Answered", "Failed", "Refused", "NotRun", "LineOutcome", "BatchStore", "ENDPOINTS",
           "ACTIVE", "MESSAGES", "RESULTS"]

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MESSAGES = "/v1/messages"
"""The endpoint of Anthropic's Message Batches (api/routes/anthropic_batches.py): requests given
inline, not a file; not one of OpenAI's :data:`ENDPOINTS`, so neither API lists the other's."""
RESULTS = "message_batch_results"
"""The purpose of a Message Batch's produced files: their lines render as Anthropic's results."""
ACTIVE = ("in_progress", "cancelling")
"""The statuses housekeeping still advances."""


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[BatchError] = []


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class FileList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "file"
    deleted: bool = True


class BatchList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchCreate(msgspec.Struct, kw_only=True):
    """``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class InputLine(msgspec.Struct, kw_only=True):
    """One line of a batch input file."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class LineError(msgspec.Struct, kw_only=True):
    """A line refused before it ran: its status and body as the endpoint would have answered."""

    status: int
    body: msgspec.Raw
    """The endpoint's error body, as JSON (rendered by the API's dialect when it refused the line)."""


class StoredLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A validated line: its translated requests (a completions line with a list of prompts has
    several), or the error it gets without running."""

    custom_id: str
    requests: list[GenerationRequest] = []
    error: LineError | None = None


# --- a line's outcome, as housekeeping gathers it and the API renders it ---------------------------
# Every outcome carries the line's custom_id and the request id its rendered line shows
# (``batch_req_<id>``, ``response.request_id``): a job id, or ``<batch id>_<line>`` for a line
# that never ran.


class Answered(msgspec.Struct, kw_only=True, tag="answered"):
    """Every job of the line is done: an output-file line, the endpoint's own 200 body."""

    custom_id: str
    request_id: str
    """The line's first job: the response's id."""
    created: int
    """Epoch seconds the first job was queued: the response's ``created``."""
    requests: list[GenerationRequest]
    """As queued (their dialect says which endpoint renders them)."""
    results: list[JobResult]


class Failed(msgspec.Struct, kw_only=True, tag="failed"):
    """A job of the line ended with an error: the endpoint's error status and body."""

    custom_id: str
    request_id: str
    """The job that failed."""
    error: JobError


class Refused(msgspec.Struct, kw_only=True, tag="refused"):
    """Refused when the batch was created, with the status and body the endpoint answered."""

    custom_id: str
    request_id: str
    error: LineError


class NotRun(msgspec.Struct, kw_only=True, tag="not_run"):
    """The batch's own error, no response: cancelled or expired before or while it ran, or its
    job's record expired before it was gathered."""

    custom_id: str
    request_id: str
    code: str
    message: str


LineOutcome = Answered | Failed | Refused | NotRun


_JSON_FIELDS = {"errors": BatchErrors, "metadata": dict[str, str]}
_LIST_CHUNK = 500
"""Batch ids looked at per round trip while a listing page is filled."""
_COUNTS = ("total", "completed", "failed")


class BatchStore:
    """Files and batches in Redis. A batch's own keys share its hash tag; the listing indexes
    (``files``, ``batches``, ``batches:active``) are separate keys, written after the batch."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.scripts = scripts.Scripts(redis)

    # --- files ----------------------------------------------------------------------------------

    async def put_file(self, meta: FileObject, content: bytes, owner: str = "") -> None:
        await reply(self.redis.hset(self.keys.file(meta.id), mapping={"meta": encode(meta), "content": content,
                                                                      "owner": owner}))
        await self.redis.zadd(self.keys.files(), {meta.id: meta.created_at})

    async def get_file(self, file_id: str) -> tuple[FileObject, str] | None:
        meta, owner = await reply(self.redis.hmget(self.keys.file(file_id), ["meta", "owner"]))
        return (msgspec.json.decode(meta, type=FileObject), (owner or b"").decode()) if meta else None

    async def file_content(self, file_id: str) -> bytes | None:
        return await reply(self.redis.hget(self.keys.file(file_id), "content"))

    async def put_outcomes(self, meta: FileObject, outcomes: bytes, owner: str = "") -> None:
        """A batch's output or error file as housekeeping leaves it: its lines' outcomes, one
        JSON document a line, in line order. Its size (``meta.bytes``) is known once rendered."""
        await reply(self.redis.hset(self.keys.file(meta.id), mapping={"meta": encode(meta), "outcomes": outcomes,
                                                                      "owner": owner}))
        await self.redis.zadd(self.keys.files(), {meta.id: meta.created_at})

    async def outcomes(self, file_id: str) -> bytes | None:
        """The outcomes of a file not rendered yet; None once it is (or for an uploaded file)."""
        return await reply(self.redis.hget(self.keys.file(file_id), "outcomes"))

    async def put_rendered(self, meta: FileObject, content: bytes) -> bool:
        """Replace the file's outcomes with its rendered content and size; False when it was
        rendered already or deleted meanwhile (then nothing is written)."""
        return bool(await self.scripts.run(scripts.file_rendered(self.keys.file(meta.id), encode(meta), content)))

    async def delete_file(self, file_id: str) -> bool:
        await self.redis.zrem(self.keys.files(), file_id)
        return bool(await self.redis.delete(self.keys.file(file_id)))

    async def list_files(self) -> list[tuple[FileObject, str]]:
        found = []
        for raw in await self.redis.zrevrange(self.keys.files(), 0, -1):
            got = await self.get_file(raw.decode())
            if got is not None:
                found.append(got)
        return found

    # --- batches --------------------------------------------------------------------------------

    async def create(self, batch: BatchObject, lines: list[StoredLine], owner: str = "") -> None:
        await self.scripts.run(scripts.batch_create(self.keys.batch(batch.id), self.keys.batch_lines(batch.id),
                                                    {**self._fields(batch), "owner": owner, "next": "0"},
                                                    [encode(line) for line in lines]))
        await self.redis.zadd(self.keys.batches(), {batch.id: batch.created_at})
        if batch.status in ACTIVE:
            await reply(self.redis.sadd(self.keys.batches_active(), batch.id))

    async def get(self, batch_id: str) -> tuple[BatchObject, str] | None:
        return self._decoded(await reply(self.redis.hgetall(self.keys.batch(batch_id))))

    @staticmethod
    def _decoded(raw: dict[bytes, bytes]) -> tuple[BatchObject, str] | None:
        """A batch and its owner from its hash (None: it is gone)."""
        if not raw:
            return None
        fields: dict[str, Any] = {}
        for key, value in raw.items():
            name = key.decode()
            decoder = _JSON_FIELDS.get(name)
            fields[name] = msgspec.json.decode(value, type=decoder) if decoder else value.decode()
        fields["request_counts"] = {name: fields.pop(name, 0) for name in _COUNTS}
        owner = fields.pop("owner", "")
        fields.pop("next", None)
        return msgspec.convert(fields, BatchObject, strict=False), owner

    async def list(self, owner: str, after: str | None, limit: int, endpoints: tuple[str, ...] = ENDPOINTS
                   ) -> tuple[list[BatchObject], bool]:
        """``owner``'s batches of these endpoints (OpenAI's batches, or Anthropic's Message
        Batches), newest first, after its batch ``after`` (from the newest when ``after`` is none
        of these); and whether more of them remain. The listing index holds every owner's
        batches, so it is filtered before the page is cut: another owner's batches are never in
        a page, never make ``has_more`` true, and are no place to start from."""
        index = self.keys.batches()
        start = 0
        if after is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(self.keys.batch(after), ["owner", "endpoint"])
            pipe.zrevrank(index, after)
            fields, rank = await pipe.execute()
            if self._listed(fields, owner, endpoints) and rank is not None:
                start = rank + 1
        ids: list[str] = []  # the page and one more, if there is one
        seen = {after} if after is not None else set()  # ``after`` too: an index shifted meanwhile re-reads it
        while len(ids) <= limit:  # the index has every owner's batches: read on until that many are ours
            chunk = [raw.decode() for raw in await self.redis.zrevrange(index, start, start + _LIST_CHUNK - 1)]
            if not chunk:
                break
            start += len(chunk)
            pipe = self.redis.pipeline(transaction=False)
            for batch_id in chunk:
                pipe.hmget(self.keys.batch(batch_id), ["owner", "endpoint"])
            for batch_id, fields in zip(chunk, await pipe.execute(), strict=True):
                # A batch created meanwhile shifts the index by one: an id read twice counts once.
                if self._listed(fields, owner, endpoints) and batch_id not in seen:
                    ids.append(batch_id)
                    seen.add(batch_id)
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids[:limit]:
            pipe.hgetall(self.keys.batch(batch_id))
        found = [got[0] for raw in (await pipe.execute() if ids else []) if (got := self._decoded(raw)) is not None]
        return found, len(ids) > limit

    @staticmethod
    def _listed(fields: Sequence[bytes | None], owner: str, endpoints: tuple[str, ...]) -> bool:
        """Whether a batch's ``owner`` and ``endpoint`` fields make it one of ``owner``'s listed
        batches (a batch deleted meanwhile has neither)."""
        who, endpoint = fields
        return who is not None and endpoint is not None and who.decode() == owner and endpoint.decode() in endpoints

    async def delete(self, batch: BatchObject) -> None:
        """Forget an ended batch: its record, its listing entry, its produced files."""
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                await self.delete_file(file_id)
        await self.redis.zrem(self.keys.batches(), batch.id)
        await self.redis.delete(self.keys.batch(batch.id), self.keys.batch_lines(batch.id),
                                self.keys.batch_jobs(batch.id), self.keys.batch_output(batch.id),
                                self.keys.batch_errors(batch.id))

    async def transition(self, batch_id: str, allowed: tuple[str, ...], status: str, at: int,
                         **fields: scripts.Value) -> bool:
        """Move the batch to ``status`` (stamping ``<status>_at``) only from one of ``allowed``,
        atomically, so a cancel and housekeeping's own moves never overwrite each other."""
        moved = await self.scripts.run(scripts.batch_status(self.keys.batch(batch_id), status, at, allowed, fields))
        if moved and status not in ACTIVE:
            await reply(self.redis.srem(self.keys.batches_active(), batch_id))
        return bool(moved)

    @staticmethod
    def _fields(batch: BatchObject) -> dict[str, bytes | str]:
        fields: dict[str, bytes | str] = {name: str(getattr(batch.request_counts, name)) for name in _COUNTS}
        for name in batch.__struct_fields__:
            value = getattr(batch, name)
            if value is None or name == "request_counts":
                continue
            fields[name] = encode(value) if name in _JSON_FIELDS else str(value)
        return fields
