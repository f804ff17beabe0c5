"""Webhooks end to end: a job queued with a ``webhook`` URL is POSTed, signed, to a local
receiver by the real housekeeping process (arq), retried with backoff, and delivered once.

Real Redis, the real API on a port, the worker loop with a scripted engine, the real
``python -m workers.housekeeping`` process, and a receiver that answers from a script.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import uvicorn
from litestar import Litestar, Request, Response, post
from litestar.params import FromPath

from shared.keys import Keys
from shared.webhooks import ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from tests.background import housekeeping
from tests.conftest import free_port
from tests.scripted_engine import ScriptedEngine
from tests.scripted_stack import scripted_stack

SECRET = "test-secret"
# The receivers listen on loopback, which the default policy refuses (tests/integration/test_webhook_egress.py).
ALLOW = "127.0.0.1/32"


class Receiver:
    """Answers each hook's requests from its plan of statuses (200 once the plan runs out), or
    redirects it to the URL in ``redirects``."""

    def __init__(self) -> None:
        self.plans: dict[str, list[int]] = {}
        self.redirects: dict[str, str] = {}
        self.hits: dict[str, list[tuple[float, dict[str, str], bytes]]] = defaultdict(list)
        self.url = ""

    async def hits_of(self, name: str, count: int, timeout_s: float = 30) -> list[tuple[float, dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout_s
        while len(self.hits[name]) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.hits[name]


@asynccontextmanager
async def receiver(certfile: Path | None = None, name: str = "127.0.0.1") -> AsyncIterator[Receiver]:
    """A receiver on loopback; with ``certfile`` (key and chain, PEM) it speaks https, and its
    ``url`` names it ``name``."""
    rx = Receiver()

    @post("/hook/{name:str}", status_code=200)
    async def hook(request: Request, name: FromPath[str]) -> Response:
        rx.hits[name].append((time.monotonic(), dict(request.headers), await request.body()))
        if name in rx.redirects:
            return Response(b"", status_code=307, headers={"Location": rx.redirects[name]})
        plan = rx.plans.get(name) or []
        return Response(b"", status_code=plan.pop(0) if plan else 200)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Litestar([hook]), host="127.0.0.1", port=port, log_level="warning",
                                           ssl_certfile=certfile))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    rx.url = f"{'https' if certfile else 'http'}://{name}:{port}"
    try:
        yield rx
    finally:
        server.should_exit = True
        await task


async def _finished(client, job_id: str) -> dict:
    for _ in range(400):
        view = (await client.get(f"/v1/jobs/{job_id}")).json()
        if view["status"] not in ("queued", "running"):
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never finished")


async def test_a_webhook_is_signed_retried_with_backoff_and_delivered_once(redis_url, prefix, tmp_path):
    async with receiver() as rx, scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow=ALLOW) as s:
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow=ALLOW):
            rx.plans["flaky"] = [500, 503]  # two retryable failures, then 200
            job_id = (await s.client.post("/v1/jobs", json={
                "prompt": "hi", "sampling": {"max_tokens": 5}, "webhook": f"{rx.url}/hook/flaky"})).json()["id"]
            view = await _finished(s.client, job_id)
            hits = await rx.hits_of("flaky", 3)
            assert len(hits) == 3, hits

            for _, headers, body in hits:
                assert headers[ID_HEADER.lower()] == job_id
                assert verify(SECRET, body, headers)
                assert not verify("another-secret", body, headers)
                assert not verify(SECRET, body + b" ", headers)  # the MAC covers the body...
                stale = {**headers, TIMESTAMP_HEADER: str(int(headers[TIMESTAMP_HEADER.lower()]) - 1)}
                assert not verify(SECRET, body, stale)  # ...and the timestamp
                assert headers[SIGNATURE_HEADER.lower()].startswith("sha256=")
                assert json.loads(body) == view  # the job exactly as GET /v1/jobs/{id} shows it
            assert view["status"] == "done" and view["result"]["choices"][0]["text"]
            # Backoff: 1 s after the first failure, 2 s after the second (arq polls every 0.5 s).
            gaps = [b[0] - a[0] for a, b in zip(hits, hits[1:], strict=False)]
            assert 0.9 <= gaps[0] < 5 and 1.9 <= gaps[1] < 6, gaps

            await asyncio.sleep(0.5)
            record = await s.redis.hgetall(Keys(prefix).job("tiny", job_id))
            assert record[b"webhook_status"] == b"delivered" and record[b"webhook_attempts"] == b"3"
            assert await s.redis.xlen(Keys(prefix).webhooks("tiny")) == 0

            # Idempotent by job id: the same outbox entry again (a housekeeper that died between
            # enqueueing and deleting) starts no second delivery.
            await s.redis.xadd(Keys(prefix).webhooks("tiny"), {"job": job_id})
            await asyncio.sleep(2.5)
            assert len(rx.hits["flaky"]) == 3
            assert await s.redis.xlen(Keys(prefix).webhooks("tiny")) == 0


async def test_a_refused_webhook_is_not_retried_and_is_marked_failed(redis_url, prefix, tmp_path):
    async with receiver() as rx, scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow=ALLOW) as s:
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow=ALLOW):
            rx.plans["gone"] = [410]
            job_id = (await s.client.post("/v1/jobs", json={
                "prompt": "hi", "sampling": {"max_tokens": 3}, "webhook": f"{rx.url}/hook/gone"})).json()["id"]
            await _finished(s.client, job_id)
            await rx.hits_of("gone", 1)
            for _ in range(100):
                if (await s.redis.hget(Keys(prefix).job("tiny", job_id), "webhook_status")) == b"failed":
                    break
                await asyncio.sleep(0.05)
            assert await s.redis.hget(Keys(prefix).job("tiny", job_id), "webhook_status") == b"failed"
            await asyncio.sleep(1.5)  # a retry would have come after 1 s
            assert len(rx.hits["gone"]) == 1


async def test_cancelled_and_failed_jobs_call_their_webhook_too(redis_url, prefix, tmp_path):
    async with receiver() as rx, scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.05),
                                                webhook_secret=SECRET, webhook_allow=ALLOW, max_num_seqs=1) as s:
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow=ALLOW):
            running = (await s.client.post("/v1/jobs", json={
                "prompt": "long", "sampling": {"max_tokens": 2000},
                "webhook": f"{rx.url}/hook/cancelled"})).json()["id"]
            await asyncio.sleep(0.3)
            await s.client.delete(f"/v1/jobs/{running}")
            # Queued behind a long job on the only slot, with a deadline it cannot meet: the poll that
            # finds it overdue ends it (expire.lua), which must queue its webhook as well.
            blocker = (await s.client.post("/v1/jobs", json={"prompt": "b", "sampling": {"max_tokens": 2000}})).json()
            expired = (await s.client.post("/v1/jobs", json={
                "prompt": "x", "sampling": {"max_tokens": 3}, "timeout_s": 0.2,
                "webhook": f"{rx.url}/hook/expired"})).json()["id"]
            await asyncio.sleep(0.4)
            assert (await _finished(s.client, expired))["status"] == "failed"
            await s.client.delete(f"/v1/jobs/{blocker['id']}")

            cancelled = json.loads((await rx.hits_of("cancelled", 1))[0][2])
            assert cancelled["id"] == running and cancelled["status"] == "cancelled"
            failed = json.loads((await rx.hits_of("expired", 1))[0][2])
            assert failed["id"] == expired and failed["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize(("settings", "webhook"), [
    ({"webhook_secret": SECRET}, "ftp://example.com/hook"),
    ({"webhook_secret": SECRET}, "not a url"),
    ({}, "http://127.0.0.1:9/hook"),  # no secret configured: an unsigned delivery is refused up front
])
async def test_a_bad_or_unconfigured_webhook_is_a_400(redis_url, prefix, settings, webhook):
    async with scripted_stack(redis_url, prefix, **settings) as s:
        resp = await s.client.post("/v1/jobs", json={"prompt": "hi", "webhook": webhook})
        assert resp.status_code == 400, resp.text
        error = msgspec.json.decode(resp.content)["error"]
        assert "webhook" in (error["message"] + str(error.get("param")))
        assert await s.redis.xlen(Keys(prefix).queue("tiny")) == 0
