"""Running batches: the housekeeping process's arq cron advances every active batch each second.

One tick, per batch, oldest first:

1. gather: lines whose jobs all ended become output-file lines (status 200, the endpoint's own
   response body) or error-file lines (the endpoint's error status and body); a cancelling
   batch cancels the jobs still running;
2. fan out: queue the next lines as ordinary jobs, at most ``LLMQ_BATCH_RATE`` lines per tick
   and ``LLMQ_BATCH_MAX_IN_FLIGHT`` unfinished lines over all batches, on the lowest priority
   level, so interactive requests are always read first and a large batch never floods a queue;
3. finish: once every line is gathered, write the output and error files and move the batch to
   ``completed`` (or ``cancelled``/``expired``, with the lines never run in the error file).

Every step can be repeated safely, so a tick that dies half-way is simply finished by the next:
a line's jobs are queued with an Idempotency-Key derived from (batch, line), gathering writes
the same line again, and status moves are compare-and-set (shared/batches.py). A lock keeps
two ticks (say, of two housekeeping replicas) from running at once.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
import structlog

from api.dialects import openai_chat, openai_completions  # the endpoints' own response shapes
from shared.batches import BatchObject, BatchStore, FileObject, StoredLine
from shared.codec import encode
from shared.config import Settings
from shared.errors import Overloaded, error_from_code
from shared.keys import LEVELS, Keys
from shared.queue import Queue, now_ms
from shared.schemas import TERMINAL_STATUSES, JobRecord

__all__ = ["advance_batches"]

log = structlog.get_logger()
LOCK_MS = 60_000
BATCH_PRIORITY = LEVELS - 1  # the lowest level: workers read it only when the others are empty
_stored = msgspec.json.Decoder(StoredLine)
_jobs = msgspec.json.Decoder(tuple[str, list[str]])


class Tick:
    """One pass over the active batches, sharing this tick's budgets."""

    def __init__(self, ctx: dict[str, Any]) -> None:
        self.settings: Settings = ctx["settings"]
        self.keys: Keys = ctx["keys"]
        self.redis = ctx["redis"]
        self.queue: Queue = ctx["queue"]
        self.store = BatchStore(self.redis, self.keys)
        self.rate = self.settings.batch_rate
        self.window = self.settings.batch_max_in_flight

    async def run(self) -> None:
        ids = [raw.decode() for raw in await self.redis.smembers(self.keys.batches_active())]
        batches = []
        for batch_id in ids:
            got = await self.store.get(batch_id)
            if got is None:
                await self.redis.srem(self.keys.batches_active(), batch_id)
                continue
            batches.append(got)
            self.window -= await self.redis.hlen(self.keys.batch_jobs(batch_id))
        for batch, owner in sorted(batches, key=lambda b: b[0].created_at):
            await self.advance(batch, owner)

    async def advance(self, batch: BatchObject, owner: str) -> None:
        bound = log.bind(batch_id=batch.id)
        now = int(time.time())
        if batch.status == "in_progress" and batch.expires_at and now >= batch.expires_at:
            await self.store.transition(batch.id, ("in_progress",), "cancelling", now, ending="expired")
            batch = msgspec.structs.replace(batch, status="cancelling")
        ending = batch.status == "cancelling"
        pending = await self.gather(batch, cancel=ending)
        if not ending:
            pending += await self.fan_out(batch, owner)
        if pending:
            return
        if ending:
            final = (await self.redis.hget(self.keys.batch(batch.id), "ending") or b"cancelled").decode()
            await self.never_run(batch, "batch_expired" if final == "expired" else "batch_cancelled")
            await self.finish(batch, owner, "cancelling", final)
        elif int(await self.redis.hget(self.keys.batch(batch.id), "next") or 0) >= batch.request_counts.total:
            await self.finish(batch, owner, "in_progress", "completed")
        bound.debug("batch_advanced", pending=pending)

    async def gather(self, batch: BatchObject, *, cancel: bool) -> int:
        """Collect the lines whose jobs all ended; returns how many lines are still running."""
        pending = 0
        for line, raw in (await self.redis.hgetall(self.keys.batch_jobs(batch.id))).items():
            model, job_ids = _jobs.decode(raw)
            records = [await self.queue.get_job(model, job_id) for job_id in job_ids]
            running = [r for r in records if r is not None and r.status not in TERMINAL_STATUSES]
            if running:
                pending += 1
                if cancel:
                    for record in running:
                        await self.queue.cancel(model, record.id)
                continue
            stored = _stored.decode(await self.redis.lindex(self.keys.batch_lines(batch.id), int(line)))
            ok, out = _result_line(batch, stored, job_ids, records)
            target = self.keys.batch_output(batch.id) if ok else self.keys.batch_errors(batch.id)
            await self.redis.hset(target, line, encode(out))
            await self.redis.hdel(self.keys.batch_jobs(batch.id), line)
        await self._count(batch)
        return pending

    async def fan_out(self, batch: BatchObject, owner: str) -> int:
        """Queue the next lines within this tick's budgets; returns how many were queued."""
        key = self.keys.batch(batch.id)
        queued = 0
        while self.rate > 0 and self.window > 0:
            line = int(await self.redis.hget(key, "next") or 0)
            if line >= batch.request_counts.total:
                break
            stored = _stored.decode(await self.redis.lindex(self.keys.batch_lines(batch.id), line))
            if stored.error is not None:
                out = _line(stored, f"{batch.id}_{line}", status=stored.error.status, body=stored.error.body)
                await self.redis.hset(self.keys.batch_errors(batch.id), str(line), encode(out))
            else:
                try:
                    job_ids = [await self._enqueue(batch, owner, line, part, req)
                               for part, req in enumerate(stored.requests)]
                except Overloaded:
                    break  # the model's queue is full: this line is queued again next tick
                entry = encode((stored.requests[0].model, job_ids))
                await self.redis.hset(self.keys.batch_jobs(batch.id), str(line), entry)
                self.rate, self.window, queued = self.rate - 1, self.window - 1, queued + 1
            await self.redis.hincrby(key, "next", 1)
        await self._count(batch)
        return queued

    async def _enqueue(self, batch: BatchObject, owner: str, line: int, part: int, req) -> str:
        req = msgspec.structs.replace(req, priority=max(req.priority, BATCH_PRIORITY))
        record = JobRecord(id=uuid.uuid4().hex, model=req.model, request=req, queued_at=now_ms(), owner=owner)
        return await self.queue.enqueue(record, self.keys.batch_idempotency(batch.id, line, part),
                                        max_queued=self.settings.max_queued)

    async def never_run(self, batch: BatchObject, code: str) -> None:
        """Error-file lines for the lines a cancelled or expired batch never queued."""
        start = int(await self.redis.hget(self.keys.batch(batch.id), "next") or 0)
        for line in range(start, batch.request_counts.total):
            stored = _stored.decode(await self.redis.lindex(self.keys.batch_lines(batch.id), line))
            message = "The batch was cancelled before this request ran." if code == "batch_cancelled" else \
                "The batch expired before this request ran."
            out = _line(stored, f"{batch.id}_{line}", error={"code": code, "message": message})
            await self.redis.hset(self.keys.batch_errors(batch.id), str(line), encode(out))
        await self.redis.hset(self.keys.batch(batch.id), "next", batch.request_counts.total)
        await self._count(batch)

    async def finish(self, batch: BatchObject, owner: str, current: str, final: str) -> None:
        now = int(time.time())
        if final == "completed":
            await self.store.transition(batch.id, (current,), "finalizing", now)
            current = "finalizing"
        files: dict[str, str] = {}
        for field, key, name in (("output_file_id", self.keys.batch_output(batch.id), "output"),
                                 ("error_file_id", self.keys.batch_errors(batch.id), "error")):
            lines = await self.redis.hgetall(key)
            if lines:
                content = b"".join(lines[k] + b"\n" for k in sorted(lines, key=int))
                meta = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=now,
                                  filename=f"{batch.id}_{name}.jsonl", purpose="batch_output")
                await self.store.put_file(meta, content, owner)
                files[field] = meta.id
        if await self.store.transition(batch.id, (current,), final, now, **files):
            for key in (self.keys.batch_lines(batch.id), self.keys.batch_jobs(batch.id),
                        self.keys.batch_output(batch.id), self.keys.batch_errors(batch.id)):
                await self.redis.expire(key, self.settings.result_ttl_s)
            log.info("batch_finished", batch_id=batch.id, status=final, **files)

    async def _count(self, batch: BatchObject) -> None:
        completed = await self.redis.hlen(self.keys.batch_output(batch.id))
        failed = await self.redis.hlen(self.keys.batch_errors(batch.id))
        await self.redis.hset(self.keys.batch(batch.id), mapping={"completed": completed, "failed": failed})


def _line(stored: StoredLine, request_id: str, *, status: int | None = None,
          body: dict | None = None, error: dict | None = None) -> dict[str, Any]:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{request_id}", "custom_id": stored.custom_id, "response": response, "error": error}


def _result_line(batch: BatchObject, stored: StoredLine, job_ids: list[str],
                 records: list[JobRecord | None]) -> tuple[bool, dict[str, Any]]:
    """(succeeded, the output- or error-file line) for a line whose jobs all ended."""
    head = job_ids[0]
    for job_id, record in zip(job_ids, records, strict=True):
        if record is None:
            return False, _line(stored, job_id, error={"code": "job_lost",
                                                              "message": "The request's job record expired."})
        if record.status == "cancelled":
            return False, _line(stored, job_id, error={"code": "batch_cancelled",
                                                              "message": "The batch was cancelled while this ran."})
        if record.status != "done" or record.result is None:
            err = record.error
            exc = error_from_code(err.code, err.message, err.status) if err else error_from_code(
                "generation_failed", "the job ended without a result", 500)
            status, body = openai_completions.error_body(exc)
            return False, _line(stored, job_id, status=status, body=body)
    created = int(records[0].queued_at // 1000)  # type: ignore[union-attr]
    results = [r.result for r in records]  # type: ignore[union-attr]
    if batch.endpoint == "/v1/chat/completions":
        body = openai_chat.render_result(stored.requests[0], results[0], head, created)
    else:
        body = openai_completions.render_results(stored.requests, results, head, created)
    return True, _line(stored, head, status=200, body=body)


async def advance_batches(ctx: dict[str, Any]) -> None:
    """The cron entry point: one tick, unless another tick still holds the lock."""
    keys: Keys = ctx["keys"]
    redis = ctx["redis"]
    token = uuid.uuid4().hex
    if not await redis.set(keys.batches_lock(), token, nx=True, px=LOCK_MS):
        return
    try:
        await Tick(ctx).run()
    finally:
        if await redis.get(keys.batches_lock()) == token.encode():
            await redis.delete(keys.batches_lock())
