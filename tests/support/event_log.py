"""A job's event log read straight from Redis by a synchronous test (the e2e suites): the stream
while the job runs, the compact log (shared/eventlog.py) once its worker ended it.
``JobStore.read_events`` is the asynchronous reader the services use. And the same log as the API
serves it (``GET /v1/jobs/{id}/events``, from a seq on: the resume path), frame by frame. And a
short finished log to write, for the queue's own tests."""

from __future__ import annotations

import json
import time

from redis import Redis

from shared import eventlog
from shared.events import Done, TokenDelta, Tokens
from shared.framing import KEEPALIVE
from shared.keys import Keys
from shared.result import ResultBuilder
from shared.schemas import JobResult, Usage

__all__ = ["logged_events", "sse_frames", "read_job_sse", "record_text", "ended_record", "still_running",
           "finished_log"]


def finished_log(prompt_tokens: int) -> tuple[list[Tokens], Done, JobResult]:
    """A short job's whole log as its worker writes it: three tokens (seq 1-3, ``t1``..``t3``),
    its Done at seq 4 (``!``, finished by length), and the result the worker stores with the Done
    (built by the same ResultBuilder)."""
    tokens = [Tokens(seq=i, deltas=[TokenDelta(token_ids=[i], text=f"t{i}")]) for i in (1, 2, 3)]
    done = Done(seq=4, deltas=[TokenDelta(token_ids=[4], text="!", finish_reason="length")],
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=4))
    builder = ResultBuilder()
    for event in (*tokens, done):
        builder.add(event)
    return tokens, done, builder.result()


def record_text(raw: dict[bytes, bytes]) -> dict[str, str]:
    """A job record as ``HGETALL`` returns it, as text: every field but a finished job's compact
    event log (``log``: deflated bytes, read by :func:`logged_events`)."""
    return {k.decode(): v.decode() for k, v in raw.items() if k != b"log"}


def still_running(redis: Redis, keys: Keys, model: str, job_id: str) -> bool:
    """The record says running and no end is logged: a job's end is logged in its token shard
    (with its ending, Keys.ending) a moment before its record says so (docs/architecture.md)."""
    return redis.hget(keys.job(model, job_id), "status") == b"running" and not redis.exists(keys.ending(model, job_id))


def ended_record(redis: Redis, keys: Keys, model: str, job_id: str, timeout_s: float = 10) -> dict[bytes, bytes]:
    """The job's record once it says how the job ended (``HGETALL``), waiting for the moment
    between its end being logged (what a client streaming it has seen) and its record saying so."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = redis.hgetall(keys.job(model, job_id))
        if raw.get(b"status") not in (b"queued", b"running") or time.monotonic() > deadline:
            return raw
        time.sleep(0.02)


def sse_frames(raw: bytes) -> list[bytes]:
    """An SSE body's event frames, keep-alive comments dropped."""
    return [f + b"\n\n" for f in raw.split(b"\n\n") if f and f + b"\n\n" != KEEPALIVE]


async def read_job_sse(client, job_id: str, after: int | None = None) -> bytes:
    """A job's events as ``GET /v1/jobs/{id}/events`` streams them (``after``: resumed after that
    seq, Last-Event-ID), read to the end through ``client`` (an httpx client of the API)."""
    headers = {} if after is None else {"Last-Event-ID": str(after)}
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
        assert resp.status_code == 200
        return await resp.aread()


def logged_events(redis: Redis, keys: Keys, model: str, job_id: str) -> list[tuple[int, dict]]:
    """(seq, event) of every logged event, in order; [] when there is no log."""
    log = keys.events(model, job_id)
    # One MULTI: the worker's end swaps the stream for the compact log between two plain reads.
    pipe = redis.pipeline(transaction=True)
    pipe.type(log)
    pipe.xrange(log)
    pipe.hmget(keys.job(model, job_id), "log", "result")  # Job.finish keeps the compact log in the record
    kind, entries, (compact, result) = pipe.execute(raise_on_error=False)
    if kind == b"stream":
        return [(int(entry_id.split(b"-")[0]), json.loads(fields[b"e"])) for entry_id, fields in entries]
    if compact is not None:
        return [(e["seq"], e) for e in json.loads(eventlog.expand(compact, result))]
    return []
