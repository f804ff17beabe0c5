"""Running batches: the housekeeping process's arq cron advances every active batch each second.

One tick, per batch, oldest first:

1. gather: lines whose jobs all ended become output-file lines (their results) or error-file
   lines (the error a job ended with, or why the line never ran): each kept as the line's
   outcome (shared/batches.py), which the API renders in the endpoint's own response shape when
   the file is first read (api/batch_output.py), so nothing here speaks a wire dialect. A
   cancelling batch cancels the jobs still running;
2. fan out: queue the next lines as ordinary jobs, at most ``LLMQ_BATCH_RATE`` lines per tick
   and ``LLMQ_BATCH_MAX_IN_FLIGHT`` unfinished lines over all batches, on the lowest priority
   level, so interactive requests are always read first and a large batch never floods a queue.
   A line's jobs are due when the batch expires (unless the line set its own timeout): waiting
   on the lowest level, they may wait long, and the batch's completion window is the client's
   deadline, not the server's default for interactive requests (``LLMQ_DEADLINE_S``);
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

import msgspec
import structlog

from shared.admission import new_job
from shared.batches import (
    MESSAGES,
    RESULTS,
    Answered,
    BatchObject,
    BatchStore,
    Failed,
    FileObject,
    LineOutcome,
    NotRun,
    Refused,
    StoredLine,
)
from shared.codec import encode
from shared.errors import GenerationFailed, NotDurable, Overloaded, QueueRefused
from shared.keys import LEVELS
from shared.media import HOLD_MARGIN_S, MediaStore
from shared.queue import now_ms
from shared.redis import REDIS_DOWN, reply
from shared.schemas import TERMINAL_STATUSES, GenerationRequest, JobError, JobRecord
from shared.tenants import DEFAULT_TENANT, TenantConfig, read_config
from workers.housekeeping.housekeeper import Housekeeper

__all__ = ["advance_batches"]

log = structlog.get_logger()
LOCK_MS = 60_000
BATCH_PRIORITY = LEVELS - 1  # the lowest level: workers read it only when the others are empty
_stored = msgspec.json.Decoder(StoredLine)
_jobs = msgspec.json.Decoder(tuple[str, list[str]])


class Tick:
    """One pass over the active batches, sharing this tick's budgets."""

    def __init__(self, hk: Housekeeper) -> None:
        self.settings, self.keys, self.redis, self.queue = hk.settings, hk.keys, hk.redis, hk.queue
        self.store = BatchStore(self.redis, self.keys)
        self.media = MediaStore(self.redis, self.keys, self.settings.media_ttl_s)  # its lines' images
        self.rate = self.settings.batch_rate
        self.window = self.settings.batch_max_in_flight

    async def run(self) -> None:
        active: set[bytes] = await reply(self.redis.smembers(self.keys.batches_active()))
        batches = []
        for batch_id in (raw.decode() for raw in active):
            got = await self.store.get(batch_id)
            if got is None:
                await reply(self.redis.srem(self.keys.batches_active(), batch_id))
                continue
            batches.append(got)
            self.window -= await self._count_of(self.keys.batch_jobs(batch_id))
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
            how: bytes | None = await reply(self.redis.hget(self.keys.batch(batch.id), "ending"))
            final = (how or b"cancelled").decode()
            await self.never_run(batch, final)
            await self.finish(batch, owner, "cancelling", final)
        elif await self._next_line(batch.id) >= batch.request_counts.total:
            await self.finish(batch, owner, "in_progress", "completed")
        bound.debug("batch_advanced", pending=pending)

    async def gather(self, batch: BatchObject, *, cancel: bool) -> int:
        """Collect the lines whose jobs all ended; returns how many lines are still running."""
        pending = 0
        in_flight: dict[bytes, bytes] = await reply(self.redis.hgetall(self.keys.batch_jobs(batch.id)))
        for field, raw in in_flight.items():
            line = field.decode()  # the line's number, which names it in each of the batch's hashes
            model, job_ids = _jobs.decode(raw)
            records = [await self.queue.get_job(model, job_id) for job_id in job_ids]
            running = [r for r in records if r is not None and r.status not in TERMINAL_STATUSES]
            if running:
                pending += 1
                if cancel:
                    for record in running:
                        await self.queue.cancel(model, record.id)
                continue
            out = _outcome(await self._stored_line(batch.id, int(line)), job_ids, records)
            target = self.keys.batch_output(batch.id) if isinstance(out, Answered) else self.keys.batch_errors(batch.id)
            await self._keep(target, line, out)
            await reply(self.redis.hdel(self.keys.batch_jobs(batch.id), line))
        await self._count(batch)
        return pending

    async def fan_out(self, batch: BatchObject, owner: str) -> int:
        """Queue the next lines within this tick's budgets; returns how many were queued."""
        key = self.keys.batch(batch.id)
        queued = 0
        while self.rate > 0 and self.window > 0:
            line = await self._next_line(batch.id)
            if line >= batch.request_counts.total:
                break
            stored = await self._stored_line(batch.id, line)
            if stored.error is not None:
                out = Refused(custom_id=stored.custom_id, request_id=f"{batch.id}_{line}", error=stored.error)
                await self._keep(self.keys.batch_errors(batch.id), str(line), out)
            else:
                try:
                    job_ids = [await self._enqueue(batch, owner, line, part, req)
                               for part, req in enumerate(stored.requests)]
                except (Overloaded, QueueRefused, NotDurable, *REDIS_DOWN):
                    # The model's queue is full, or Redis takes no new job now (its memory, a
                    # failover): this line is queued again next tick, under the same idempotency key.
                    break
                entry = encode((stored.requests[0].model, job_ids))
                await reply(self.redis.hset(self.keys.batch_jobs(batch.id), mapping={str(line): entry}))
                self.rate, self.window, queued = self.rate - 1, self.window - 1, queued + 1
            await reply(self.redis.hincrby(key, "next", 1))
        await self._count(batch)
        return queued

    async def _enqueue(self, batch: BatchObject, owner: str, line: int, part: int, req: GenerationRequest) -> str:
        # No SLO: a line is bulk work whose deadline is its batch's window. A tenant's interactive
        # TTFT default would end lines that wait behind interactive traffic, as they are meant to.
        req = msgspec.structs.replace(req, priority=max(req.priority or 0, BATCH_PRIORITY), slo=None)
        now = now_ms()
        # Due when the batch expires (always set: POST /v1/batches gives every batch its window).
        window_s = max((batch.expires_at or 0) - now / 1000, 0.001)  # > 0: 0 would mean "no deadline"
        tenant = owner or DEFAULT_TENANT
        if req.images:  # kept to the line's deadline (a worker fails the line should one be gone)
            await self.media.renew([image.sha256 for image in req.images], hold_s=window_s + HOLD_MARGIN_S)
        record = new_job(req, owner=owner, default_timeout_s=window_s, now_ms=now, tenant=tenant,
                         max_model_len=self.settings.max_model_len)
        # Its tenant's weight, not its limits: a batch line waits for room rather than failing.
        config = await read_config(self.redis, self.keys, tenant)
        return await self.queue.enqueue(record, self.keys.batch_idempotency(batch.id, line, part),
                                        max_queued=self.settings.max_queued, tenant=TenantConfig(weight=config.weight))

    async def never_run(self, batch: BatchObject, final: str) -> None:
        """Error-file lines for the lines a batch that ended ``final`` (cancelled or expired)
        never queued."""
        code, message = _NEVER_RUN["expired" if final == "expired" else "cancelled"]
        for line in range(await self._next_line(batch.id), batch.request_counts.total):
            stored = await self._stored_line(batch.id, line)
            out = NotRun(custom_id=stored.custom_id, request_id=f"{batch.id}_{line}", code=code, message=message)
            await self._keep(self.keys.batch_errors(batch.id), str(line), out)
        await reply(self.redis.hset(self.keys.batch(batch.id), mapping={"next": batch.request_counts.total}))
        await self._count(batch)

    async def finish(self, batch: BatchObject, owner: str, current: str, final: str) -> None:
        now = int(time.time())
        if final == "completed":
            await self.store.transition(batch.id, (current,), "finalizing", now)
            current = "finalizing"
        files: dict[str, str] = {}
        for field, key, name in (("output_file_id", self.keys.batch_output(batch.id), "output"),
                                 ("error_file_id", self.keys.batch_errors(batch.id), "error")):
            lines: dict[bytes, bytes] = await reply(self.redis.hgetall(key))
            if lines:
                content = b"".join(lines[k] + b"\n" for k in sorted(lines, key=int))
                # bytes: set when the API renders the outcomes, on the file's first read.
                # A Message Batch's files render as Anthropic's result lines (api/batch_output.py).
                purpose = RESULTS if batch.endpoint == MESSAGES else "batch_output"
                meta = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=0, created_at=now,
                                  filename=f"{batch.id}_{name}.jsonl", purpose=purpose)
                await self.store.put_outcomes(meta, content, owner)
                files[field] = meta.id
        if await self.store.transition(batch.id, (current,), final, now, **files):
            for key in (self.keys.batch_lines(batch.id), self.keys.batch_jobs(batch.id),
                        self.keys.batch_output(batch.id), self.keys.batch_errors(batch.id)):
                await self.redis.expire(key, self.settings.result_ttl_s)
            log.info("batch_finished", batch_id=batch.id, status=final, **files)

    async def _count(self, batch: BatchObject) -> None:
        completed = await self._count_of(self.keys.batch_output(batch.id))
        failed = await self._count_of(self.keys.batch_errors(batch.id))
        await reply(self.redis.hset(self.keys.batch(batch.id), mapping={"completed": completed, "failed": failed}))

    # The reads below state their replies' types, which redis-py's annotations do not give for our
    # asyncio client (shared.redis.reply).

    async def _next_line(self, batch_id: str) -> int:
        """The batch's next line to queue, or to count as never run (0 before its first)."""
        raw: bytes | None = await reply(self.redis.hget(self.keys.batch(batch_id), "next"))
        return int(raw or 0)

    async def _stored_line(self, batch_id: str, line: int) -> StoredLine:
        return _stored.decode(await reply(self.redis.lindex(self.keys.batch_lines(batch_id), line)))

    async def _count_of(self, key: str) -> int:
        """How many fields the hash at ``key`` holds (lines gathered into a file, or in flight)."""
        return await reply(self.redis.hlen(key))

    async def _keep(self, key: str, line: str, out: LineOutcome) -> None:
        """``out`` as the outcome of ``line`` in the output or error file's hash at ``key``."""
        await reply(self.redis.hset(key, mapping={line: encode(out)}))


# OpenAI's error-file code for the lines a batch never queued, and its message, by how it ended.
_NEVER_RUN = {"expired": ("batch_expired", "The batch expired before this request ran."),
              "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran.")}


def _outcome(stored: StoredLine, job_ids: list[str], records: list[JobRecord | None]) -> LineOutcome:
    """The outcome of a line whose jobs all ended: its results, or the first reason it has none."""
    for job_id, record in zip(job_ids, records, strict=True):
        if record is None:
            return NotRun(custom_id=stored.custom_id, request_id=job_id, code="job_lost",
                          message="The request's job record expired.")
        if record.status == "cancelled":
            return NotRun(custom_id=stored.custom_id, request_id=job_id, code="batch_cancelled",
                          message="The batch was cancelled while this ran.")
        if record.status != "done" or record.result is None:
            error = record.error or JobError.of(GenerationFailed("the job ended without a result"))
            return Failed(custom_id=stored.custom_id, request_id=job_id, error=error)
    done = [(r.queued_at, r.result) for r in records if r is not None and r.result is not None]
    # The requests as the line translated them (its jobs' only differ in the batch's priority).
    return Answered(custom_id=stored.custom_id, request_id=job_ids[0], created=int(done[0][0] // 1000),
                    requests=stored.requests, results=[result for _, result in done])


async def advance_batches(hk: Housekeeper) -> None:
    """One tick, unless another tick (say, another housekeeping replica's) still holds the lock."""
    token = uuid.uuid4().hex
    if not await hk.redis.set(hk.keys.batches_lock(), token, nx=True, px=LOCK_MS):
        return
    try:
        await Tick(hk).run()
    finally:
        if await hk.redis.get(hk.keys.batches_lock()) == token.encode():
            await hk.redis.delete(hk.keys.batches_lock())
