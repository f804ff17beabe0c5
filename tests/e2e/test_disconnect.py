"""A client that leaves frees its vLLM slot: the job is cancelled and the engine request aborted.

Real processes (API + vLLM worker). A 500-token ``ignore_eos`` generation would run for many
seconds on this CPU; the client reads the first chunk (or, non-streaming, waits until the job
runs) and closes its socket. The job record must end ``cancelled`` and the worker's heartbeat
must report no running job, quickly. The figures are printed; the bound asserted is generous
(the issue's target is 1 s; the heartbeat itself is refreshed every LLMQ_HEARTBEAT_S=1 s).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from redis.asyncio import Redis

from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import connect
from tests.support.job_records import running_job
from tests.support.waiting import eventually

BOUND_S = 5.0


async def _open(url: str, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> float:
    gone_at = time.time() * 1000
    writer.close()
    await writer.wait_closed()
    return gone_at


async def _heartbeat_idle_at(redis: Redis, keys: Keys, model: str, after_ms: float) -> float:
    """The time (epoch ms) of the first heartbeat written after ``after_ms`` in which every
    ready worker reports ``running`` 0 (heartbeats are written every LLMQ_HEARTBEAT_S)."""
    async def idle_beat() -> float | None:
        nonlocal after_ms
        workers = [w.decode() for w in await redis.zrange(keys.workers(model), 0, -1)]
        beats = [await redis.hmget(keys.worker(w), "running", "last_heartbeat") for w in workers]
        if workers and all(b[1] and float(b[1]) > after_ms for b in beats):
            if all(b[0] == b"0" for b in beats):
                return max(float(b[1]) for b in beats)
            after_ms = max(float(b[1]) for b in beats)  # still busy at that beat: wait for the next
        return None
    return await eventually(idle_beat, timeout_s=30, what="a heartbeat with every worker idle")


async def _until_finished(queue: JobStore, model: str, job_id: str):
    async def finished():
        rec = await queue.get_job(model, job_id)
        return rec if rec is not None and rec.status in ("cancelled", "done", "failed") else None
    return await eventually(finished, timeout_s=60, interval_s=0.02, what=f"job {job_id} to end")


async def _check(stack, redis: Redis, job_id: str, gone_at: float, what: str, figures) -> None:
    keys = Keys(stack.prefix)
    rec = await _until_finished(JobStore(redis, keys), stack.model, job_id)
    assert rec.status == "cancelled", rec
    assert rec.error is not None and rec.error.code == "cancelled"
    assert rec.started_at is not None  # it was running in the engine when the client left
    freed_s = (rec.finished_at - gone_at) / 1000
    idle_s = (await _heartbeat_idle_at(redis, keys, stack.model, rec.finished_at) - gone_at) / 1000
    print(f"\n{what}: job cancelled (slot free) {freed_s:.3f} s after the client left; "
          f"first heartbeat with running=0 {idle_s:.3f} s after it left")
    figures.requests_sent, figures.ended_with_error = 1, 1  # cancelled, as asked
    figures.seconds.update(slot_free_s=freed_s, heartbeat_idle_s=idle_s)
    assert freed_s < BOUND_S
    assert idle_s < BOUND_S


@pytest.mark.faults
async def test_streaming_client_disconnect_frees_the_slot(stack, figures):
    redis = connect(stack.redis_url)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
        reader, writer = await _open(stack.url, "/v1/completions", body)
        buf = b""
        async with asyncio.timeout(120):
            while b"data: {" not in buf:
                chunk = await reader.read(4096)
                assert chunk, buf
                buf += chunk
        job_id = buf.split(b'"id":"cmpl-', 1)[1].split(b'"', 1)[0].decode()
        gone_at = await _close(writer)
        await _check(stack, redis, job_id, gone_at, "streaming disconnect", figures)
    finally:
        await redis.aclose()


@pytest.mark.faults
async def test_non_streaming_client_disconnect_frees_the_slot(stack, figures):
    redis = connect(stack.redis_url)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}
        _, writer = await _open(stack.url, "/v1/completions", body)
        job_id = await running_job(redis, Keys(stack.prefix), stack.model, timeout_s=60)
        await asyncio.sleep(0.5)  # let it generate a little: the abort hits a running engine request
        gone_at = await _close(writer)
        await _check(stack, redis, job_id, gone_at, "non-streaming disconnect", figures)
    finally:
        await redis.aclose()
