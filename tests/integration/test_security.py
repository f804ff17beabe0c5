"""API keys, per-key job access, body size limit and a password-protected Redis: the real app on
a real port, a scripted worker, real Redis."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator

import aiohttp
import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, ResponseError

from shared.keys import Keys
from shared.redis import REDIS_DOWN, connect, redis_server_binary
from tests.conftest import free_port
from tests.support.job_records import MODEL, record, wait_status
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_settings, scripted_stack

# --- API keys ----------------------------------------------------------------------------------


UNAUTHORIZED_CASES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 401,
     lambda b: b["error"]["type"] == "AuthenticationError" and b["error"]["code"] == 401),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 401,
     lambda b: b["error"]["type"] == "AuthenticationError"),
    ("/generate", {"inputs": "x"}, 401, lambda b: b["error_type"] == "unauthorized"),
    ("/generate_stream", {"inputs": "x"}, 401, lambda b: b["error_type"] == "unauthorized"),
    ("/invocations", {"inputs": "x"}, 401, lambda b: b["code"] == 401 and b["type"] == "unauthorized"),
    (f"/predictions/{MODEL}", {"inputs": "x"}, 401, lambda b: b["type"] == "unauthorized"),
    (f"/v2/models/{MODEL}/generate", {"text_input": "x"}, 401, lambda b: set(b) == {"error"}),
    ("/v1/generate", {"prompt": "x"}, 401, lambda b: set(b) == {"detail"}),
    ("/v1/jobs", {"prompt": "x"}, 401, lambda b: b["error"]["code"] == "unauthorized"),
]
OPEN_PATHS = ["/ping", "/health", "/liveness", "/readiness", "/v2/health/live", "/v2/health/ready",
              f"/v2/models/{MODEL}/ready"]


async def test_api_keys_guard_every_generation_and_job_route(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, api_keys="key-one, key-two") as s:
        for path, body, status, check in UNAUTHORIZED_CASES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                            {"Authorization": "Basic a2V5LW9uZQ=="}):
                resp = await s.client.post(path, json=body, headers=headers)
                assert resp.status_code == status, (path, headers, resp.text)
                assert check(resp.json()), (path, resp.json())
            assert resp.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/models", "/info", "/v2", "/v1/info", "/v1/jobs/whatever"):
            assert (await s.client.get(path)).status_code == 401, path
        for path in OPEN_PATHS:
            assert (await s.client.get(path)).status_code == 200, path
        one = {"Authorization": "Bearer key-one"}
        resp = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=one)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "hi"
        resp = await s.client.post("/generate", json={"inputs": "hey", "parameters": {"max_new_tokens": 3}},
                                   headers={"x-api-key": "key-two"})
        assert resp.status_code == 200 and resp.json()["generated_text"] == "hey"


async def test_a_job_is_visible_only_to_the_key_that_queued_it(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.05), api_keys="key-one,key-two") as s:
        one, two = {"x-api-key": "key-one"}, {"Authorization": "Bearer key-two"}
        resp = await s.client.post("/v1/jobs", json={"prompt": "mine", "sampling": {"max_tokens": 100}},
                                   headers=one)
        job_id = resp.json()["id"]
        raw = await s.redis.hget(Keys(prefix).job(MODEL, job_id), "owner")
        assert raw and b"key-one" not in raw  # a hash, never the key itself
        for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/events"),
                             ("DELETE", f"/v1/jobs/{job_id}")):
            other = await s.client.request(method, path, headers=two)
            assert other.status_code == 404, (method, path)
            assert other.json() == {"error": {"code": "job_not_found", "message": f"job {job_id} not found",
                                              "param": None, "status": 404}}
        missing = await s.client.get("/v1/jobs/0123456789abcdef0123456789abcdef", headers=two)
        assert missing.status_code == 404  # the same answer as another key's job
        assert (await s.client.get(f"/v1/jobs/{job_id}", headers=one)).json()["status"] in ("queued", "running")
        # An Idempotency-Key is per API key: the same key from another caller is a new job.
        idem = {"Idempotency-Key": "same"}
        a = (await s.client.post("/v1/jobs", json={"prompt": "a", "sampling": {"max_tokens": 1}},
                                 headers={**one, **idem})).json()["id"]
        b = (await s.client.post("/v1/jobs", json={"prompt": "b", "sampling": {"max_tokens": 1}},
                                 headers={**two, **idem})).json()["id"]
        a2 = (await s.client.post("/v1/jobs", json={"prompt": "a", "sampling": {"max_tokens": 1}},
                                  headers={**one, **idem})).json()["id"]
        assert a != b and a == a2
        resp = await s.client.delete(f"/v1/jobs/{job_id}", headers=one)
        assert resp.status_code == 200
        assert (await wait_status(s.redis, prefix, job_id, {"cancelled"})).status == "cancelled"


async def test_lmtp_socket_needs_a_key(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, api_keys="key-one") as s:
        ws_url = s.url.replace("http://", "ws://") + "/"
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(ws_url)
            assert refused.value.status == 401
            async with session.ws_connect(ws_url, headers={"Authorization": "Bearer key-one"}) as ws:
                await ws.send_str('MODEL_INFO {"stream_id": 1, "model": "tiny"}')
                reply = await asyncio.wait_for(ws.receive_str(), 10)
                assert reply.startswith("MSG ") and "error" not in reply, reply


# --- body size ---------------------------------------------------------------------------------


async def test_body_over_the_limit_is_413_in_the_dialects_shape(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, max_body_bytes=1000) as s:
        big = "x" * 2000
        resp = await s.client.post("/v1/completions", json={"prompt": big, "max_tokens": 2})
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == 413 and "too large" in resp.json()["error"]["message"]
        resp = await s.client.post("/generate", json={"inputs": big})
        assert resp.status_code == 413 and resp.json()["error_type"] == "payload_too_large"
        resp = await s.client.post(f"/v2/models/{MODEL}/generate", json={"text_input": big})
        assert resp.status_code == 413 and set(resp.json()) == {"error"}
        # Chunked (no Content-Length): counted while read.
        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 200
            yield b'", "max_tokens": 2}'
        resp = await s.client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        resp = await s.client.post("/v1/completions", json={"prompt": "small", "max_tokens": 2})
        assert resp.status_code == 200


# --- Redis with a password ---------------------------------------------------------------------


async def test_password_protected_redis_works_through_the_url(tmp_path, prefix):
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir",
                             str(tmp_path), "--save", "", "--appendonly", "no", "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL)
    try:
        url = f"redis://:s3cret@127.0.0.1:{port}/0"
        probe = connect(url)
        async with asyncio.timeout(10):
            while True:
                try:
                    await probe.ping()
                    break
                except REDIS_DOWN:
                    await asyncio.sleep(0.05)
        await probe.aclose()
        # Plain redis-py here; llmq's own client on a URL without the password is covered in
        # test_redis_tls_and_auth.py (it used to recurse on NOAUTH, redis/redis-py#3745).
        anonymous = Redis.from_url(f"redis://127.0.0.1:{port}/0")
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.set("x", "1")
        await anonymous.aclose()
        settings = scripted_settings(url, prefix)
        assert settings.redis_dsn == url
        async with scripted_stack(url, prefix) as s:
            resp = await s.client.post("/v1/completions", json={"prompt": "pw", "max_tokens": 3})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "pwp"
            job_id = resp.json()["id"].removeprefix("cmpl-")
            rec = await record(s.redis, prefix, job_id)
            assert rec is not None and rec.status == "done"
            resp = await s.client.post("/v1/jobs", json={"prompt": "q", "sampling": {"max_tokens": 2}})
            job_id = resp.json()["id"]
            await wait_status(s.redis, prefix, job_id, {"done"})
            assert (await s.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"
    finally:
        proc.terminate()
        proc.wait(10)
