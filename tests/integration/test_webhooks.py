"""Webhooks end to end: a job queued with a ``webhook`` URL is POSTed, signed, to a local
receiver by the real housekeeping process (arq), retried with backoff, and delivered once.

Real Redis, the real API on a port, the worker loop with a scripted engine, the real
``python -m workers.housekeeping`` process, and a receiver that answers from a script.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from shared.keys import Keys
from shared.webhooks import ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from tests.support.background import housekeeping
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import job_status
from tests.support.webhook_receiver import SECRET, receiver

# The receivers listen on loopback, which the default policy refuses (tests/integration/test_webhook_egress.py).
ALLOW = "127.0.0.1/32"


async def test_a_webhook_is_signed_retried_with_backoff_and_delivered_once(redis_url, prefix, tmp_path):
    async with receiver() as rx, scripted_stack(redis_url, prefix, webhook_secret=SECRET, webhook_allow=ALLOW) as s:
        with housekeeping(redis_url, prefix, tmp_path, webhook_secret=SECRET, webhook_allow=ALLOW):
            rx.plans["flaky"] = [500, 503]  # two retryable failures, then 200
            job_id = (await s.client.post("/v1/jobs", json={
                "prompt": "hi", "sampling": {"max_tokens": 5}, "webhook": f"{rx.url}/hook/flaky"})).json()["id"]
            view = await job_status(s.client, job_id)
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
            await job_status(s.client, job_id)
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
            assert (await job_status(s.client, expired))["status"] == "failed"
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
