"""A steady fire-and-poll load on a running llmq API, and the check of what became of every job
it was promised: the machinery of the Redis failover fault rows (tests/integration/test_redis_failover.py).

:class:`Load` runs ``producers`` clients that each ``POST /v1/jobs`` with ``Prefer: respond-async``
and a fresh ``Idempotency-Key`` (which the prompt embeds, so the engine's books name it), one after
another. A 202 is an *acknowledgement*: llmq has promised to run that job. A 503, a connection
error or a timeout is retried with the same key after the answer's Retry-After (capped, so the
first acknowledgement after a fault is seen to within a fraction of a second) until acknowledged
or the load stops; any other answer ends that key and is counted (a 500 on its own).

:func:`verify` then checks every acknowledged job: its record exists (through the API, and on
the slot's current primary), it reaches a terminal state, and it ran once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
from redis.asyncio import Redis

from shared.keys import Keys
from shared.schemas import TERMINAL_STATUSES
from tests.support.scripted_engine import ScriptedEngine

__all__ = ["Ack", "Load", "LoadResult", "verify"]

RETRY_CAP_S = 0.25
"""The longest a producer waits before retrying a refused key, whatever Retry-After says."""


@dataclass(frozen=True)
class Ack:
    job_id: str
    sent_at: float
    """When the attempt that was acknowledged was sent (time.monotonic)."""
    acked_at: float


@dataclass
class LoadResult:
    acked: int = 0
    acked_but_lost: int = 0
    not_acked: int = 0
    """Keys still being retried when the load stopped: never promised, so never lost."""
    refused_503: int = 0
    retried: int = 0
    """Attempts that were retries of a refused or failed one (503, connection error, timeout)."""
    connection_errors: int = 0
    """Attempts that got no answer (reset, or none within the client's timeout): the API hung."""
    errors_500: int = 0
    unexpected: dict[int, int] = field(default_factory=dict)
    """Other statuses (400, 429, ...), which a correct run never answers: status -> count."""
    done: int = 0
    ended_with_error: int = 0
    """Acknowledged jobs that failed or were cancelled: finished, and said why."""
    not_terminal: int = 0
    """Acknowledged jobs whose record exists but that did not finish within the deadline."""
    kill_to_switch_s: float | None = None
    kill_to_next_ack_s: float | None = None
    enqueue_p50_ms: float = 0.0
    enqueue_p99_ms: float = 0.0
    lost: list[str] = field(default_factory=list, repr=False)
    """The keys of the acknowledged-but-lost jobs (the first few name them in a failure)."""
    two_jobs: list[str] = field(default_factory=list, repr=False)
    """Keys whose prompt ran under a job id besides the one acknowledged: the client's one
    request (one Idempotency-Key) run as two jobs."""
    run_again: list[str] = field(default_factory=list, repr=False)
    """Keys whose one job the engine ran more than once: a worker's claim or result rolled back
    with the primary, and the job was delivered again (at-least-once)."""
    twice: dict[str, list[str]] = field(default_factory=dict, repr=False)
    """For each key of either list: the job ids the engine ran for it, in order."""

    @property
    def run_twice(self) -> int:
        """Keys whose prompt the engine ran more than once, for either reason."""
        return len({*self.two_jobs, *self.run_again})


class Load:
    """``async with Load(url) as load:`` runs the producers until the block ends (or :meth:`stop`)."""

    def __init__(self, base_url: str, *, producers: int = 8, max_tokens: int = 1, timeout_s: float = 10) -> None:
        self.run = uuid.uuid4().hex[:8]
        self.producers, self.max_tokens = producers, max_tokens
        self.client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=producers))
        self.acks: dict[str, Ack] = {}
        self.pending: set[str] = set()
        """Keys sent and not acknowledged yet."""
        self.latencies_ms: list[float] = []
        """Of the acknowledged attempts: the enqueue latency a client sees."""
        self.statuses: Counter[int] = Counter()
        self.refused = self.retried = self.connection_errors = 0
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def prompt(key: str) -> str:
        return f"job {key}"

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._produce(i)) for i in range(self.producers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop sending; the attempts in flight finish (bounded by the client's timeout), so an
        acknowledgement the server sent is never dropped by the client."""
        self._stopping.set()
        if self._tasks:
            await asyncio.gather(*self._tasks)
            self._tasks = []
        await self.client.aclose()

    def first_ack_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first acknowledgement of an attempt sent after ``t``."""
        later = [a.acked_at for a in self.acks.values() if a.sent_at >= t]
        return min(later) - t if later else None

    async def _produce(self, producer: int) -> None:
        n = 0
        while not self._stopping.is_set():
            key = f"{self.run}-{producer}-{n}"
            n += 1
            self.pending.add(key)
            body = {"prompt": self.prompt(key), "sampling": {"max_tokens": self.max_tokens}}
            headers = {"Prefer": "respond-async", "Idempotency-Key": key}
            for attempt in itertools.count():
                if self._stopping.is_set():
                    break
                self.retried += attempt > 0
                sent = time.monotonic()
                try:
                    resp = await self.client.post("/v1/jobs", json=body, headers=headers)
                except httpx.TransportError:  # refused, reset, timed out: the API may be the one down
                    self.connection_errors += 1
                    await self._pause(RETRY_CAP_S)
                    continue
                self.statuses[resp.status_code] += 1
                if resp.status_code in (200, 202):
                    now = time.monotonic()
                    self.acks[key] = Ack(resp.json()["id"], sent, now)
                    self.latencies_ms.append((now - sent) * 1000)
                    self.pending.discard(key)
                elif resp.status_code == 503:
                    self.refused += 1
                    await self._pause(_retry_after(resp))
                    continue
                else:
                    self.pending.discard(key)
                break

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(max(float(resp.headers.get("retry-after", RETRY_CAP_S)), 0.0), RETRY_CAP_S)
    except ValueError:
        return RETRY_CAP_S


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def verify(load: Load, client: httpx.AsyncClient, redis: Redis, keys: Keys, model: str,
                 engine: ScriptedEngine | None = None, *, deadline_s: float = 60, concurrency: int = 8) -> LoadResult:
    """What became of every job ``load`` was promised, once its load has stopped. ``client``: the
    API's; ``redis``: a client of the deployment (on a Cluster, it reads the slot's current
    primary). A job is lost when ``GET /v1/jobs/{id}`` answers 404 and its record is not in
    Redis. ``engine`` (the stack's scripted engine) tells which prompts ran more than once."""
    result = LoadResult(
        acked=len(load.acks), not_acked=len(load.pending), refused_503=load.refused, retried=load.retried,
        connection_errors=load.connection_errors, errors_500=load.statuses[500],
        unexpected={s: n for s, n in load.statuses.items() if s not in (200, 202, 500, 503)},
        enqueue_p50_ms=_percentile(load.latencies_ms, 50), enqueue_p99_ms=_percentile(load.latencies_ms, 99),
    )
    waiting = dict(load.acks)  # key -> its ack, until its job is terminal or found lost
    statuses: dict[str, str] = {}
    gate = asyncio.Semaphore(concurrency)

    async def check(key: str, ack: Ack) -> None:
        async with gate:
            resp = await client.get(f"/v1/jobs/{ack.job_id}")
            if resp.status_code == 404:
                # The API found no record: confirm it on the primary that serves the slot now.
                if not await redis.hexists(keys.job(model, ack.job_id), "status"):
                    result.lost.append(key)
                    del waiting[key]
                return
            resp.raise_for_status()
            statuses[key] = resp.json()["status"]
            if statuses[key] in TERMINAL_STATUSES:
                del waiting[key]

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline_s):
            while waiting:
                await asyncio.gather(*(check(k, a) for k, a in list(waiting.items())))
                if waiting:
                    await asyncio.sleep(0.2)
    result.acked_but_lost, result.not_terminal = len(result.lost), len(waiting)
    result.done = sum(status == "done" for status in statuses.values())
    result.ended_with_error = sum(status in ("failed", "cancelled") for status in statuses.values())

    # Every run of each acknowledged key's prompt, by job id. An id other than the one acknowledged
    # is a second job for the key: an attempt refused with a 503 that was queued and ran all the
    # same, and whose record the retry did not find. The same id twice is one job delivered again
    # (its claim or its result lost with the primary).
    runs: dict[str, list[str]] = {key: [] for key in load.acks}
    if engine is not None:
        by_prompt = {load.prompt(key): key for key in load.acks}
        for job_id, req in zip(engine.started, engine.requests, strict=True):
            if (key := by_prompt.get(req.prompt or "")) is not None:
                runs[key].append(job_id)
    result.two_jobs = sorted(k for k, ids in runs.items() if set(ids) - {load.acks[k].job_id})
    result.run_again = sorted(k for k, ids in runs.items() if len(ids) > len(set(ids)))
    result.twice = {k: runs[k] for k in {*result.two_jobs, *result.run_again}}
    return result
