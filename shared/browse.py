"""Reading the deployment for people: the console's JSON routes (api/routes/overview.py) and scripts.

Everything here reads, but for :func:`sample` (housekeeping's history of each model's queue) and
:func:`discard_dead_letter`. Its sources are the keys documented in shared/keys.py:

- recent jobs: ``Keys.recent``, a capped stream written when a job is queued (its id, tenant and
  dialect), then a few fields of each record (never its prompt or output);
- dead letters: ``Keys.dead``, with the dead job's record;
- each level's throughput: ``Keys.finished`` counters, sampled into ``Keys.history`` every few
  seconds by housekeeping (:func:`sample`), so a chart of the last ten minutes is there at once;
- tenants: their fair-share state and today's usage (shared/tenants.py), read for everyone and
  kept a second (:class:`TenantRows`).

Who sees what is the caller's business: each reader takes ``owner``, the key hash whose jobs
alone it returns (None: every job, for an operator).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Iterable

import msgspec
from redis.asyncio import Redis
from redis.typing import EncodableT

from shared.keys import LEVELS, Keys
from shared.schemas import JobError, runs_of, token_counts_of
from shared.tenants import USAGE_FIELDS, TenantConfig, UsageRow, read_states, today, usage_row

__all__ = ["JobSummary", "ErrorSummary", "DeadLetterView", "HistoryPoint", "TenantRow",
           "recent_jobs", "dead_letters", "find_dead_letter", "discard_dead_letter", "restore_dead_letter",
           "sample", "history", "throughput", "tenant_rows", "TenantRows", "HISTORY_S", "SAMPLE_S"]

SAMPLE_S = 5
"""How often housekeeping samples each model's queue into its history."""
HISTORY_S = 600
"""How far back the history goes."""
_PAGE = 200
"""Recent-stream entries read per round trip while a filtered list is being filled."""
_SCAN_MAX = 5000
"""At most this many of the newest jobs are looked at per model for one list: a filter that
matches nothing in them returns what it found, not a scan of the whole stream."""
_SUMMARY_FIELDS = ["status", "owner", "queued_at", "started_at", "first_token_at", "finished_at", "attempt",
                   "preemptions", "worker", "runs", "tokens", "error"]
_error = msgspec.json.Decoder(JobError)


class ErrorSummary(msgspec.Struct, kw_only=True):
    code: str
    message: str


class JobSummary(msgspec.Struct, kw_only=True):
    """One row of the recent jobs: what it is, how long it waited, who ran it. No prompt, no output."""

    id: str
    model: str
    status: str
    dialect: str
    tenant: str
    queued_at: float
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    queue_ms: float | None
    """From queued to its first start."""
    ttft_ms: float | None
    """From queued to its first token (what a client waited)."""
    prompt_tokens: int | None
    generated_tokens: int | None
    attempts: int
    preemptions: int
    workers: list[str]
    """Every worker that ran it, in order, each once."""
    error: ErrorSummary | None
    queue_position: int | None = None
    """While it waits (the list's first queued rows only): jobs of its model estimated to start before it."""
    eta_s: float | None = None
    """While it waits: seconds until it is estimated to start (null while unknown)."""


def _float(raw: bytes | None) -> float | None:
    return float(raw) if raw else None


def _error_of(raw: bytes | None) -> ErrorSummary | None:
    if not raw:
        return None
    try:
        err = _error.decode(raw)
    except msgspec.DecodeError:
        return ErrorSummary(code="unknown_error", message="(unreadable)")
    return ErrorSummary(code=err.code, message=err.message)


def _summary(model: str, job_id: str, tenant: str, dialect: str, f: list[bytes | None]) -> JobSummary:
    status, _, queued, started, first_token, finished, attempt, preemptions, worker, runs, tokens, error = f
    text = lambda raw: (raw or b"").decode()  # noqa: E731
    queued_at = float(queued or 0)
    started_at, first_token_at = _float(started), _float(first_token)
    ran = runs_of(text(runs), int(attempt or 0), text(worker), started_at)
    prompt_tokens, generated_tokens = token_counts_of(text(tokens))
    return JobSummary(
        id=job_id, model=model, status=text(status) or "?", dialect=dialect, tenant=tenant,
        queued_at=queued_at, started_at=started_at, first_token_at=first_token_at, finished_at=_float(finished),
        queue_ms=round(ran[0].started_at - queued_at, 1) if ran else None,
        ttft_ms=round(first_token_at - queued_at, 1) if first_token_at is not None else None,
        prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, attempts=int(attempt or 0),
        preemptions=int(preemptions or 0), workers=list(dict.fromkeys(r.worker for r in ran)),
        error=_error_of(error))


def _visible(owner: str | None, record_owner: bytes | None) -> bool:
    return owner is None or hmac.compare_digest((record_owner or b""), owner.encode())


async def recent_jobs(redis: Redis, keys: Keys, models: Iterable[str], *, owner: str | None, limit: int = 50,
                      tenant: str | None = None, status: str | None = None,
                      dialect: str | None = None) -> list[JobSummary]:
    """The newest jobs of ``models`` that pass the filters, newest first; only ``owner``'s unless None."""
    found: list[JobSummary] = []
    for model in models:
        found += await _recent_of(redis, keys, model, owner, limit, tenant, status, dialect)
    return sorted(found, key=lambda j: j.queued_at, reverse=True)[:limit]


async def _recent_of(redis: Redis, keys: Keys, model: str, owner: str | None, limit: int, tenant: str | None,
                     status: str | None, dialect: str | None) -> list[JobSummary]:
    out: list[JobSummary] = []
    end, scanned = "+", 0
    page = limit  # the first page is the list itself when nothing filters it (the console's poll)
    while len(out) < limit and scanned < _SCAN_MAX:
        entries = await redis.xrevrange(keys.recent(model), max=end, count=page)
        if not entries:
            break
        scanned += len(entries)
        end = "(" + entries[-1][0].decode()
        # What the entry says filters first (its owner too: a tenant's list reads only its own
        # records), then each record left is read once.
        rows = [(f[b"job"].decode(), f[b"tenant"].decode(), f.get(b"dialect", b"").decode()) for _, f in entries
                if b"owner" not in f or _visible(owner, f[b"owner"])]  # an entry from before the field: its record
        rows = [r for r in rows if (tenant is None or r[1] == tenant) and (dialect is None or r[2] == dialect)]
        pipe = redis.pipeline(transaction=False)
        for job_id, _, _ in rows:
            pipe.hmget(keys.job(model, job_id), _SUMMARY_FIELDS)
        for (job_id, who, kind), f in zip(rows, await pipe.execute() if rows else [], strict=True):
            if f[0] is None or not _visible(owner, f[1]):  # expired, or another key's
                continue
            if status is None or f[0].decode() == status:
                out.append(_summary(model, job_id, who, kind, f))
        if len(entries) < page:
            break
        page = _PAGE
    return out[:limit]


class DeadLetterView(msgspec.Struct, kw_only=True):
    job_id: str
    model: str
    tenant: str
    dialect: str
    attempts: int
    at: float
    """When it was dead-lettered (epoch ms)."""
    error: ErrorSummary | None


async def dead_letters(redis: Redis, keys: Keys, models: Iterable[str], *, owner: str | None,
                       limit: int = 200) -> list[DeadLetterView]:
    """The newest dead letters of ``models`` whose job record still exists, newest first."""
    out: list[DeadLetterView] = []
    for model in models:
        entries = await redis.xrevrange(keys.dead(model), count=limit)
        pipe = redis.pipeline(transaction=False)
        for _, f in entries:
            pipe.hmget(keys.job(model, f[b"job"].decode()), ["owner", "tenant", "error", "request"])
        replies = await pipe.execute() if entries else []
        for (_, f), (rec_owner, tenant, error, request) in zip(entries, replies, strict=True):
            if request is None or not _visible(owner, rec_owner):
                continue
            out.append(DeadLetterView(
                job_id=f[b"job"].decode(), model=model, tenant=(tenant or rec_owner or b"default").decode(),
                dialect=_dialect_of(request), attempts=int(f.get(b"attempts", b"0")), at=float(f.get(b"at", b"0")),
                error=_error_of(error)))
    return sorted(out, key=lambda d: d.at, reverse=True)[:limit]


class _Dialect(msgspec.Struct):
    dialect: str = "jobs"


def _dialect_of(request: bytes) -> str:
    try:
        return msgspec.json.decode(request, type=_Dialect).dialect
    except msgspec.DecodeError:
        return "?"


async def find_dead_letter(redis: Redis, keys: Keys, model: str,
                           job_id: str) -> tuple[bytes, dict[bytes, bytes]] | None:
    """The dead-letter entry of ``job_id``: its id and fields (a scan of the capped stream: an
    operator's action)."""
    start = "-"
    while entries := await redis.xrange(keys.dead(model), min=start, count=1000):
        for entry_id, f in entries:
            if f[b"job"].decode() == job_id:
                return entry_id, f
        start = "(" + entries[-1][0].decode()
    return None


async def discard_dead_letter(redis: Redis, keys: Keys, model: str, entry_id: bytes) -> bool:
    """False: it was gone already (another operator took it)."""
    return await redis.xdel(keys.dead(model), entry_id) == 1


async def restore_dead_letter(redis: Redis, keys: Keys, model: str, fields: dict[bytes, bytes]) -> None:
    """Put a dead letter back (a requeue that could not queue its job), as it was but newest."""
    await redis.xadd(keys.dead(model), fields)  # type: ignore[arg-type]  # bytes: see sample()


# --- each level's history ---------------------------------------------------------------------

async def _levels(redis: Redis, keys: Keys, model: str) -> list[tuple[int, int, int]]:
    """Per level (waiting, running, finished so far): XLEN of the waiting and queue streams (a
    picked job is in its queue stream until it ends), and the finished counter."""
    pipe = redis.pipeline(transaction=False)
    for level in range(LEVELS):
        pipe.xlen(keys.waiting(model, level))
        pipe.xlen(keys.queue(model, level))
    pipe.hgetall(keys.finished(model))
    *lens, finished = await pipe.execute()
    return [(lens[2 * lv], lens[2 * lv + 1], int(finished.get(str(lv).encode(), 0))) for lv in range(LEVELS)]


async def sample(redis: Redis, keys: Keys, model: str) -> None:
    """Append one sample of ``model``'s levels to its history (housekeeping, every SAMPLE_S)."""
    # xadd's own type: a dict is invariant, so to mypy a dict[str, int] (or [bytes, bytes]) is not one.
    fields: dict[EncodableT, EncodableT] = {}
    for level, (waiting, running, finished) in enumerate(await _levels(redis, keys, model)):
        fields |= {f"w{level}": waiting, f"r{level}": running, f"f{level}": finished}
    await redis.xadd(keys.history(model), fields, maxlen=HISTORY_S // SAMPLE_S + 10, approximate=False)


class HistoryPoint(msgspec.Struct, kw_only=True):
    at: float
    """Epoch seconds."""
    waiting: int
    running: int
    finished_per_min: float | None
    """Jobs finished per minute since the sample before (None for the first)."""


def _point_fields(f: dict[bytes, bytes]) -> tuple[int, int, list[int]]:
    get = lambda name: int(f.get(name.encode(), b"0"))  # noqa: E731
    return (sum(get(f"w{lv}") for lv in range(LEVELS)), sum(get(f"r{lv}") for lv in range(LEVELS)),
            [get(f"f{lv}") for lv in range(LEVELS)])


async def history(redis: Redis, keys: Keys, model: str, now_s: float | None = None) -> list[HistoryPoint]:
    """The last HISTORY_S of samples, oldest first."""
    now_s = time.time() if now_s is None else now_s
    since = int((now_s - HISTORY_S) * 1000)
    entries = await redis.xrange(keys.history(model), min=str(since))
    points, before = [], None
    for entry_id, f in entries:
        at_ms = int(entry_id.split(b"-")[0])
        waiting, running, finished = _point_fields(f)
        rate = None
        if before is not None and at_ms > before[0]:
            rate = round((sum(finished) - sum(before[1])) * 60_000 / (at_ms - before[0]), 2)
        points.append(HistoryPoint(at=at_ms / 1000, waiting=waiting, running=running, finished_per_min=rate))
        before = (at_ms, finished)
    return points


async def throughput(redis: Redis, keys: Keys, model: str, now_s: float | None = None) -> list[float | None]:
    """Per level, jobs finished per minute over about the last minute: the finished counters now
    against the oldest history sample of the last 60 s (None per level: no sample that old yet)."""
    now_ms = (time.time() if now_s is None else now_s) * 1000
    window = await redis.xrange(keys.history(model), min=str(int(now_ms - 60_000)), count=1)
    if not window:
        return [None] * LEVELS
    then_ms = int(window[0][0].split(b"-")[0])
    if now_ms - then_ms < SAMPLE_S * 1000:
        return [None] * LEVELS
    _, _, before = _point_fields(window[0][1])
    now_levels = await _levels(redis, keys, model)
    return [round((now_levels[lv][2] - before[lv]) * 60_000 / (now_ms - then_ms), 2) for lv in range(LEVELS)]


# --- tenants ----------------------------------------------------------------------------------

class TenantRow(msgspec.Struct, kw_only=True):
    tenant: str
    model: str
    weight: float
    fair_share: float | None
    """Its weight's part of the weights of every tenant with jobs running or waiting on the model
    (None: it has none): the share of tokens fair share aims to give it while all of them wait."""
    share_last_minute: float | None
    tokens_last_minute: int
    running: int
    waiting: int
    limits: TenantConfig
    today: UsageRow
    """Its usage of the model today (UTC), from the jobs that ended."""


async def tenant_rows(redis: Redis, keys: Keys, models: Iterable[str], *, most: int = 500) -> list[TenantRow]:
    """Every tenant known on each model, with its state and today's usage; at most ``most``
    tenants per model, those first seen earliest. Everyone's rows: the caller shows each viewer
    its own (one tenant's fair share needs every busy tenant's weight, so all are read anyway).
    A round trip for every model's tenants and usage, then one per model for all its tenants."""
    models, day = list(models), today()
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.zrange(keys.tenants(model), 0, most - 1)
        pipe.hgetall(keys.usage(model, day))
    replies = await pipe.execute() if models else []
    rows: list[TenantRow] = []
    for model, names, usage in zip(models, replies[::2], replies[1::2], strict=True):
        states = await read_states(redis, keys, model, [n.decode() for n in names])
        busy = [s for s in states if s.running or sum(s.waiting)]
        active = sum(s.weight for s in busy)
        for s in states:
            own = usage_row(day, model, {f: int(usage.get(f"{s.tenant}:{f}".encode(), 0)) for f in USAGE_FIELDS})
            rows.append(TenantRow(
                tenant=s.tenant, model=model, weight=s.weight,
                fair_share=round(s.weight / active, 4) if s in busy and active else None,
                share_last_minute=s.share_last_minute, tokens_last_minute=s.tokens_last_minute,
                running=s.running, waiting=sum(s.waiting), limits=s.config, today=own))
    return rows


class TenantRows:
    """:func:`tenant_rows`, read at most once per ``ttl_s`` by one process: every open console
    polls the tenants every 2 s, and any key may ask as often as it likes. It keeps everyone's
    rows, so what a caller may see is decided after it, per caller, never by who filled it.

    Callers that find it stale together share one read (a burst of requests costs one read, not
    one each); a read that failed is not kept, so the next caller tries again."""

    def __init__(self, ttl_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self._read: tuple[float, tuple[str, ...], asyncio.Task[list[TenantRow]]] | None = None

    async def get(self, redis: Redis, keys: Keys, models: Iterable[str]) -> list[TenantRow]:
        wanted, now = tuple(models), time.monotonic()
        if self._read is None or self._stale(now, wanted):
            task = asyncio.create_task(tenant_rows(redis, keys, wanted))
            task.add_done_callback(_observed)
            self._read = (now, wanted, task)
        # Shielded: a caller that leaves (its client gone) does not cancel the others' read.
        return await asyncio.shield(self._read[2])

    def _stale(self, now: float, wanted: tuple[str, ...]) -> bool:
        assert self._read is not None
        started, models, task = self._read
        if models != wanted:
            return True
        if not task.done():
            return False  # join the read under way
        return task.cancelled() or task.exception() is not None or now - started >= self.ttl_s


def _observed(task: asyncio.Task[list[TenantRow]]) -> None:
    """Every caller may have left before a shared read ended: its error is read here, so asyncio
    does not log it as never retrieved (the callers that stayed got it)."""
    if not task.cancelled():
        task.exception()
