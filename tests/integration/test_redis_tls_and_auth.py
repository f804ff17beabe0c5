"""Redis passwords, ACL users and TLS (``rediss://``) through LLMQ_REDIS_URL, on real redis-servers.

TLS runs through ``tests/support/tls_proxy.py`` (the shipped redis-server has no TLS): the client's TLS
handshake and certificate check are real, the proxy forwards plaintext to the real server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import structlog
import trustme
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.keys import Keys
from shared.queue import Consumer
from shared.redis import connect, redis_server_binary, wait_for_redis
from tests.conftest import REPO, free_port, wait_for_ping
from tests.support.job_records import record, wait_status
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_settings, scripted_stack, serve_api
from tests.support.tls_proxy import TlsProxy, tls_proxy, write_ca
from workers.runner import Worker

PASSWORD = "s3cret-pw"
ACL_USER, ACL_PASSWORD = "llmq", "user-pw"
FAIL_FAST_BOUND_S = 5.0  # generous: before the fix, a URL without the password hit a RecursionError after ~11 s


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("redis://").split("/")[0].rsplit("@", 1)[-1].split(":")
    return host, int(port)


@pytest.fixture
def secured_redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server with ``requirepass`` and an ACL user allowed every key, command and channel."""
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir",
                             str(tmp_path), "--save", "", "--appendonly", "no", "--requirepass", PASSWORD],
                            stdout=subprocess.DEVNULL)
    try:
        admin = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        wait_for_ping(admin)
        from redis import Redis as SyncRedis

        with SyncRedis.from_url(admin) as client:
            client.execute_command("ACL", "SETUSER", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def tls(redis_url: str, tmp_path: Path) -> AsyncIterator[TlsProxy]:
    async with tls_proxy(*_host_port(redis_url), tmp_path) as proxy:
        yield proxy


async def _run_jobs(url: str, prefix: str) -> list[str]:
    """The API and a worker, both on ``url``: one completion and one queued job; their ids."""
    async with scripted_stack(url, prefix) as s:
        resp = await s.client.post("/v1/completions", json={"prompt": "tls", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "tls"
        rec = await record(s.redis, prefix, resp.json()["id"].removeprefix("cmpl-"))
        assert rec is not None and rec.status == "done"
        resp = await s.client.post("/v1/jobs", json={"prompt": "q", "sampling": {"max_tokens": 2}})
        assert resp.status_code in (200, 201, 202), resp.text
        job_id = resp.json()["id"]
        await wait_status(s.redis, prefix, job_id, {"done"})
        assert (await s.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"
        return [rec.id, job_id]


# --- TLS ---------------------------------------------------------------------------------------


async def test_rediss_url_runs_jobs_end_to_end_over_verified_tls(tls, redis_url, prefix):
    assert tls.url().startswith("rediss://")
    job_ids = await _run_jobs(tls.url(), prefix)
    # Every client connection (API commands, its pub/sub listener, the worker) did a TLS handshake...
    assert len(tls.handshakes) >= 3 and all(v.startswith("TLSv1.") for v in tls.handshakes)
    print(f"{len(tls.handshakes)} TLS handshakes: {sorted(set(tls.handshakes))}")
    # ...and reached the real redis-server behind the proxy: the records are there, in plaintext Redis.
    plain = connect(redis_url)
    try:
        for job_id in job_ids:
            rec = await record(plain, prefix, job_id)
            assert rec is not None and rec.status == "done"
    finally:
        await plain.aclose()


async def test_rediss_with_a_foreign_ca_fails_fast_with_a_tls_error(tls, tmp_path):
    stranger = write_ca(trustme.CA(), tmp_path / "other-ca.pem")
    url = tls.url().replace(str(tls.ca_path), str(stranger))
    client = connect(url)
    started = time.monotonic()
    try:
        async with asyncio.timeout(FAIL_FAST_BOUND_S):
            with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.ping()
    finally:
        await client.aclose()
    print(f"foreign CA refused in {time.monotonic() - started:.2f}s")
    assert tls.handshakes == []  # no connection got past the handshake


async def test_rediss_checks_the_host_name_when_asked(tls, redis_url, tmp_path):
    # The fixture's certificate names 127.0.0.1 and localhost: both verify.
    url = tls.url().replace("rediss://127.0.0.1:", "rediss://localhost:")
    client = connect(url)
    try:
        assert await client.ping() is True
    finally:
        await client.aclose()
    # A certificate for another name, from the trusted CA: refused with ssl_check_hostname=true,
    # accepted without it (redis-py's default is off, hence the option in every documented URL).
    async with tls_proxy(*_host_port(redis_url), tmp_path / "other", names=("redis.internal",)) as other:
        strict = connect(other.url())
        lax = connect(other.url(check_hostname=False))
        try:
            async with asyncio.timeout(FAIL_FAST_BOUND_S):
                with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                    await strict.ping()
            assert await lax.ping() is True
        finally:
            await strict.aclose()
            await lax.aclose()


# --- passwords and ACL users ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["password", "acl_user", "acl_user_over_tls"])
async def test_password_and_acl_user_urls_run_jobs_end_to_end(secured_redis, prefix, tmp_path, form):
    port = secured_redis
    admin = connect(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    try:
        if form == "password":
            await _run_jobs(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", prefix)
            return
        if form == "acl_user":
            url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}/0"
            async with scripted_stack(url, prefix) as s:
                # The stack's connections really are the ACL user's, not the default user's.
                assert ACL_USER in {c["user"] for c in await admin.client_list()}
                resp = await s.client.post("/v1/completions", json={"prompt": "acl", "max_tokens": 3})
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "acl"
            return
        async with tls_proxy("127.0.0.1", port, tmp_path) as proxy:
            await _run_jobs(proxy.url(userinfo=f"{ACL_USER}:{ACL_PASSWORD}"), prefix)
            assert proxy.handshakes
    finally:
        await admin.aclose()


@pytest.mark.parametrize("userinfo", ["", ":wrong-pw", f"{ACL_USER}:wrong-pw", "nobody:x"])
async def test_missing_or_wrong_credentials_fail_fast_with_an_authentication_error(secured_redis, userinfo):
    at = f"{userinfo}@" if userinfo else ""
    client = connect(f"redis://{at}127.0.0.1:{secured_redis}/0")
    started = time.monotonic()
    try:
        async with asyncio.timeout(FAIL_FAST_BOUND_S):
            with pytest.raises(AuthenticationError):
                await client.ping()
            with pytest.raises(AuthenticationError):  # and again: the client is still usable, no recursion
                await client.set("x", "1")
    finally:
        await client.aclose()
    print(f"credentials {userinfo!r} refused in {time.monotonic() - started:.3f}s")


async def test_processes_do_not_wait_forever_on_a_wrong_password(secured_redis):
    # Workers call wait_for_redis at start: an outage is waited out, a rejected password is
    # logged once as a configuration error and raised (the process exits with it).
    client = connect(f"redis://127.0.0.1:{secured_redis}/0")
    try:
        with structlog.testing.capture_logs() as logs:
            async with asyncio.timeout(FAIL_FAST_BOUND_S):
                with pytest.raises(AuthenticationError):
                    await wait_for_redis(client, what="worker")
    finally:
        await client.aclose()
    assert [e["event"] for e in logs] == ["redis_auth_failed"]
    assert logs[0]["log_level"] == "error" and "LLMQ_REDIS_URL" in logs[0]["hint"]


async def test_api_answers_503_when_redis_rejects_its_credentials(secured_redis, prefix):
    # The API starts before Redis by design and maps a Redis it cannot use to 503.
    settings = scripted_settings(f"redis://:wrong-pw@127.0.0.1:{secured_redis}/0", prefix)
    async with serve_api(settings) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        started = time.monotonic()
        resp = await client.post("/v1/jobs", json={"prompt": "q", "sampling": {"max_tokens": 2}})
        elapsed = time.monotonic() - started
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
        assert resp.json()["error"]["code"] == "queue_unavailable"
        assert elapsed < FAIL_FAST_BOUND_S
        print(f"503 after {elapsed:.3f}s")


# --- the real API process over rediss:// --------------------------------------------------------


async def test_api_process_over_rediss_is_healthy(tls, prefix, tmp_path):
    url = tls.url()
    settings = scripted_settings(url, prefix)
    redis = connect(url)
    worker = Worker(settings, Consumer(redis, Keys(prefix)), ScriptedEngine(delay_s=0.001), worker_id=f"w-{prefix}")
    worker_task = asyncio.create_task(worker.run())
    log = (tmp_path / "api.log").open("wb")
    env = {**os.environ, "LLMQ_REDIS_URL": url, "LLMQ_PREFIX": prefix, "LLMQ_PORT": str(settings.port),
           "LLMQ_SERVED_MODEL_NAME": "tiny", "LLMQ_LOG_JSON": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "api"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.port}", timeout=5) as client:
            async with asyncio.timeout(60):
                while True:
                    try:
                        resp = await client.get("/ping")
                        if resp.status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.poll() is None, (tmp_path / "api.log").read_text()
                    await asyncio.sleep(0.2)
            assert resp.json()["status"] == "Healthy"
            done = await client.post("/v1/completions", json={"prompt": "proc", "max_tokens": 3}, timeout=30)
            assert done.status_code == 200 and done.json()["choices"][0]["text"] == "pro"
    finally:
        worker.stop()
        await asyncio.wait_for(worker_task, 10)
        await redis.aclose()
        proc.terminate()
        # In a thread: the API's shutdown talks to Redis through the proxy, which runs on this loop.
        await asyncio.to_thread(proc.wait, 15)
        log.close()
