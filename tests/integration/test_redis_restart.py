"""Redis restarts under load, with AOF persistence: no queued job is lost, nothing is restarted by
hand, and every request ends (completed, or a clear error), never hangs."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.aof_redis import AofRedis
from tests.support.faults import lost_and_duplicated
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_stack

TERMINAL = {"done", "failed", "cancelled"}

pytestmark = pytest.mark.faults


@pytest.fixture
def aof_redis(tmp_path):
    server = AofRedis(tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.stop()


async def _status(client, job_id: str) -> str | None:
    try:
        resp = await client.get(f"/v1/jobs/{job_id}")
    except Exception:
        return None
    return resp.json()["status"] if resp.status_code == 200 else None


async def test_redis_restart_with_queued_jobs(aof_redis, figures):
    engine = ScriptedEngine(delay_s=0.02)
    async with scripted_stack(aof_redis.url, "restart", engine, max_num_seqs=1, heartbeat_s=0.2) as s:
        ids = []
        for i in range(6):  # one runs, five wait in the queue
            resp = await s.client.post("/v1/jobs", json={"prompt": f"job{i}", "sampling": {"max_tokens": 20}})
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["id"])
        await asyncio.sleep(0.2)
        aof_redis.stop()
        await asyncio.sleep(1.0)  # the API answers 503 meanwhile; nothing may crash
        resp = await s.client.post("/v1/jobs", json={"prompt": "x"})
        assert resp.status_code == 503
        aof_redis.start()

        statuses: dict[str, str | None] = {}
        async with asyncio.timeout(60):
            while True:
                statuses = {job_id: await _status(s.client, job_id) for job_id in ids}
                if all(v in TERMINAL for v in statuses.values()):
                    break
                await asyncio.sleep(0.2)
        # The queued jobs survived the restart and ran; the one in flight may have ended with a
        # clear error instead, but none is lost or stuck.
        figures.requests_sent = len(ids)
        figures.completed = sum(v == "done" for v in statuses.values())
        figures.ended_with_error = sum(v in ("failed", "cancelled") for v in statuses.values())
        figures.jobs_lost = len(ids) - figures.completed - figures.ended_with_error
        assert figures.completed >= 5, statuses
        for job_id, status in statuses.items():
            body = (await s.client.get(f"/v1/jobs/{job_id}")).json()
            if status == "done":
                text = body["result"]["choices"][0]["text"]
                want = expected_text(f"job{ids.index(job_id)}", 20)
                lost, dup = lost_and_duplicated(list(want), list(text))
                figures.tokens_lost += lost
                figures.tokens_duplicated += dup
                assert text == want, body
            else:
                assert body["error"]["message"], body
        # A new request after the restart is served normally.
        resp = await s.client.post("/v1/completions", json={"prompt": "after", "max_tokens": 5})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text("after", 5)


async def test_redis_restart_mid_stream(aof_redis, figures):
    engine = ScriptedEngine(delay_s=0.02)
    async with scripted_stack(aof_redis.url, "restart-stream", engine, heartbeat_s=0.2) as s:
        body = {"prompt": "stream", "max_tokens": 60, "stream": True}

        async def read() -> bytes:
            async with s.client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                return await resp.aread()

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        aof_redis.stop()
        await asyncio.sleep(1.0)
        aof_redis.start()
        async with asyncio.timeout(60):
            raw = await reader
        assert raw.endswith(b"data: [DONE]\n\n")
        chunks = [c[len(b"data: "):] for c in raw.split(b"\n\n") if c.startswith(b"data: {")]
        objs = [json.loads(c) for c in chunks]
        errors = [o for o in objs if "error" in o]
        text = "".join(c["text"] for o in objs for c in o.get("choices", []))
        # The guarantee is "completes, or ends with a clear error"; what happens with a 1 s outage
        # is that the worker's flusher retries and the relay re-reads the log: every token, once.
        want = expected_text("stream", 60)
        figures.requests_sent, figures.completed = 1, int(not errors)
        figures.tokens_lost, figures.tokens_duplicated = lost_and_duplicated(list(want), list(text))
        assert not errors and text == want, (errors, text)
