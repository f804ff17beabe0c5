"""Known models are queued with no warm worker; a waiting client's cold wait ends in its dialect's
504 (or the stream's in-band error), and an unknown model is still the dialect's 404.

The real app on a real port and real Redis, with no worker at all: every request here waits for
one that never comes, for ``LLMQ_COLD_WAIT_S`` = 1 s. (tests/e2e/test_cold_start.py starts a real
worker after the requests and sees them complete.)
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from shared.codec import job_from_hash
from shared.keys import Keys
from shared.queue import now_ms
from tests.support.scripted_stack import scripted_settings, serve_api

PREFIX = "cold-wait"
COLD_S = 1.0
MESSAGE = "no worker became ready to serve this request within 1 s (LLMQ_COLD_WAIT_S)"


# Not the conftest's stack: these tests need an API with no worker at all (a model nobody serves).
@pytest.fixture(scope="module")
async def api(redis_url):
    settings = scripted_settings(redis_url, PREFIX, cold_wait_s=COLD_S, models="second, third")
    async with serve_api(settings) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


# (route, body, status, the dialect's error body)
SYNC = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 504,
     {"error": {"message": MESSAGE, "type": "InternalServerError", "param": None, "code": 504}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 504,
     {"error": {"message": MESSAGE, "type": "InternalServerError", "param": None, "code": 504}}),
    ("/invocations", {"inputs": "x"}, 504, {"code": 504, "type": "deadline_exceeded", "message": MESSAGE}),
    ("/predictions/tiny", {"inputs": ["x", "y"]}, 504, {"code": 504, "type": "deadline_exceeded", "message": MESSAGE}),
    ("/generate", {"inputs": "x"}, 504, {"error": MESSAGE, "error_type": "deadline_exceeded"}),
    ("/v2/models/tiny/generate", {"text_input": "x"}, 503, {"error": MESSAGE}),
    ("/v1/generate", {"prompt": "x"}, 504, {"detail": MESSAGE}),
]


@pytest.mark.parametrize(("path", "body", "status", "error"), SYNC, ids=[s[0] for s in SYNC])
async def test_a_synchronous_request_waits_its_cold_wait_then_gets_the_dialects_504(api, path, body, status, error):
    started = time.monotonic()
    resp = await api.post(path, json=body)
    waited = time.monotonic() - started
    assert (resp.status_code, resp.json()) == (status, error)
    assert COLD_S <= waited < COLD_S + 6  # queued, not refused: it waited, and not much longer


# (route, body, the stream's last frames after its keep-alives)
STREAMS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True},
     [b"data: " + json.dumps({"error": {"message": MESSAGE, "type": "InternalServerError", "param": None,
                                        "code": 504}}, separators=(",", ":")).encode(), b"data: [DONE]"]),
    ("/generate_stream", {"inputs": "x"},
     [b"data:" + json.dumps({"error": MESSAGE, "error_type": "deadline_exceeded"},
                            separators=(",", ":")).encode()]),
]


@pytest.mark.parametrize(("path", "body", "tail"), STREAMS, ids=[s[0] for s in STREAMS])
async def test_a_stream_gets_keepalives_while_it_waits_then_its_in_band_error(api, path, body, tail):
    async with api.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        lines = [line.encode() async for line in resp.aiter_lines() if line]
    assert lines[-len(tail):] == tail
    assert lines[0] == b": keep-alive"  # the keep-alive interval is 0.5 s here, the cold wait 1 s


async def test_the_job_of_a_client_whose_cold_wait_ran_out_ends_in_redis_too(api, redis):
    before = now_ms()
    resp = await api.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 504
    keys = Keys(PREFIX)
    ended = [job_from_hash(await redis.hgetall(k)) async for k in redis.scan_iter(match=keys.job("tiny", "*"))]
    mine = [j for j in ended if j.queued_at >= before]
    assert len(mine) == 1 and mine[0].status == "failed" and mine[0].error.code == "deadline_exceeded"
    # Its entry stays in the waiting stream until a worker's pick finds it ended (read.lua drops it).
    assert await redis.xlen(keys.waiting("tiny")) >= 1


async def test_fire_and_poll_jobs_wait_without_limit(api):
    resp = await api.post("/v1/jobs", json={"prompt": "x"})
    assert resp.status_code == 202
    time.sleep(COLD_S + 0.5)
    assert (await api.get(resp.headers["location"])).json()["status"] == "queued"


async def test_known_models_queue_and_unknown_ones_are_404(api, redis):
    for model in ("second", "third"):  # LLMQ_MODELS
        resp = await api.post("/v1/jobs", json={"prompt": "x", "model": model})
        assert resp.status_code == 202, resp.text
    resp = await api.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
    # A model some worker once advertised stays known after every worker of it is gone.
    await redis.zadd(Keys(PREFIX).models(), {"retired": now_ms() - 3_600_000})
    resp = await api.post("/v1/jobs", json={"prompt": "x", "model": "retired"})
    assert resp.status_code == 202, resp.text
    listed = {m["id"] for m in (await api.get("/v1/models")).json()["data"]}
    assert listed == {"tiny", "second", "third", "retired"}


async def test_web_probes_say_the_web_is_ready_while_model_probes_say_no_worker(api):
    assert (await api.get("/livez")).status_code == 200
    assert (await api.get("/readyz")).json() == {"status": "ready", "redis": "ok"}
    assert (await api.get("/ping")).status_code == 503
    assert (await api.get("/health")).status_code == 503
    assert (await api.get("/v2/health/ready")).status_code == 400
    assert (await api.get("/readiness")).json() == {"ready": "ko"}
