"""Processes started before Redis is reachable wait with backoff instead of crashing, answer 503
meanwhile, and recover on their own once Redis is up."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from shared.redis import redis_server_binary
from tests.conftest import REPO, free_port
from tests.support.waiting import eventually_sync


def _wait_for(predicate, timeout_s: float, what: str):
    return eventually_sync(predicate, timeout_s=timeout_s, interval_s=0.1, what=what, ignoring=(httpx.TransportError,))


def test_api_and_housekeeping_survive_redis_starting_late(tmp_path):
    redis_port, api_port = free_port(), free_port()
    env = {**os.environ, "LLMQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "LLMQ_PORT": str(api_port),
           "LLMQ_PREFIX": "late", "LLMQ_LOG_JSON": "true"}
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("api", "housekeeping")}
    procs = {
        "api": subprocess.Popen([sys.executable, "-m", "api"], cwd=REPO, env=env, stdout=logs["api"],
                                stderr=subprocess.STDOUT),
        "housekeeping": subprocess.Popen([sys.executable, "-m", "workers.housekeeping"], cwd=REPO, env=env,
                                         stdout=logs["housekeeping"], stderr=subprocess.STDOUT),
    }
    redis = None
    base = f"http://127.0.0.1:{api_port}"
    try:
        _wait_for(lambda: httpx.get(f"{base}/ping").status_code == 503, 30, "the API to start")
        down = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert down.status_code == 503 and down.headers["retry-after"]
        assert down.json()["error"]["type"] == "ServiceUnavailableError"
        down = httpx.post(f"{base}/invocations", json={"inputs": "x"}, timeout=10)
        assert down.status_code == 503 and down.json()["code"] == 503
        assert httpx.get(f"{base}/ping", timeout=10).status_code == 503
        time.sleep(1.5)
        assert all(p.poll() is None for p in procs.values()), "nothing may crash while Redis is away"

        redis = subprocess.Popen([redis_server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        # Back in touch with Redis, the job is queued for the default model, warm worker or not.
        queued = _wait_for(
            lambda: (r := httpx.post(f"{base}/v1/jobs", json={"prompt": "x"}, timeout=10)).status_code == 202 and r,
            20, "the API to reach Redis")
        assert queued.json()["status"] == "queued"
        _wait_for(lambda: b"housekeeping_sweep" in (tmp_path / "housekeeping.log").read_bytes(), 20,
                  "the housekeeping sweep")
        assert all(p.poll() is None for p in procs.values())
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(20)
        for log in logs.values():
            log.close()
        if redis is not None:
            redis.terminate()
            redis.wait(10)
