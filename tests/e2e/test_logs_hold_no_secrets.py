"""Nothing secret in the logs: the three real processes (web, a vLLM worker, housekeeping) run with
planted credentials (an API key, a Redis password, a webhook secret), serve requests carrying a
planted prompt, and each hits an unexpected error (tests/support/fault_wrap.py) whose message quotes the
request or the Settings. Every byte they logged is then searched for the planted values."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.logging import HIDDEN_MESSAGE
from shared.redis import redis_server_binary
from tests.conftest import free_port, wait_for_ping
from tests.support.real_processes import spawn, stop_all, tail, wait_ready
from tests.support.waiting import eventually_sync

pytestmark = pytest.mark.e2e

API_KEY = "sk-PLANTEDkey4c9e"
REDIS_PASSWORD = "PLANTEDredis7b1d"
WEBHOOK_SECRET = "PLANTEDwebhook2f8a"
PROMPT = "PLANTEDprompt about the zebra 5d3c"
PLANTED = (API_KEY, REDIS_PASSWORD, WEBHOOK_SECRET, PROMPT, "PLANTED")
MAX_LINE = 8192


@pytest.fixture
def secured_redis(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path),
                             "--save", "", "--appendonly", "no", "--requirepass", REDIS_PASSWORD],
                            stdout=subprocess.DEVNULL)
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    try:
        wait_for_ping(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_line(log: Path, needle: bytes, timeout_s: float = 60) -> None:
    eventually_sync(lambda: needle in log.read_bytes(), timeout_s=timeout_s, interval_s=0.2,
                    what=lambda: f"{needle!r} to be logged\n{tail(log)}")


def _json_lines(log: Path) -> list[dict]:
    out = []
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            out.append(json.loads(line))
    return out


def _forced_error(log: Path, matches) -> tuple[dict, str]:
    """The log line of the forced fault, which has a traceback that reaches the patched function
    and lists no frame's locals; and the RuntimeError's message as logged there."""
    [line] = [x for x in _json_lines(log) if matches(x)]
    [raised] = [s for s in line["exception"] if s["exc_type"] == "RuntimeError"]
    assert any(f["name"] == "faulty" for f in raised["frames"]), raised
    assert all("locals" not in f for s in line["exception"] for f in s["frames"])
    return line, raised["exc_value"]


def test_forced_errors_log_tracebacks_without_any_planted_secret_or_prompt(secured_redis, tmp_path):
    port = free_port()
    env = {**os.environ, "LLMQ_REDIS_URL": secured_redis, "LLMQ_PREFIX": f"e2e-{uuid.uuid4().hex[:6]}",
           "LLMQ_PORT": str(port), "LLMQ_API_KEYS": f"other-key,{API_KEY}", "LLMQ_WEBHOOK_SECRET": WEBHOOK_SECRET,
           "LLMQ_LOG_JSON": "true", "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_MAX_MODEL_LEN": "512", "LLMQ_HEARTBEAT_S": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in ("api", "workers", "housekeeping")}
    procs = [(spawn(["-m", "tests.support.fault_wrap", name], env, log), log) for name, log in logs.items()]
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    try:
        wait_ready(url, procs, 1)
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/v1/completions", json=body).status_code == 401  # no key
            first = client.post("/v1/completions", json=body, headers=auth)  # the API's forced fault
            assert first.status_code == 500, first.text
            assert PROMPT not in first.text  # an unexpected error tells the client nothing of it
            second = client.post("/v1/completions", json=body, headers=auth)  # the worker's forced fault
            assert second.status_code == 500 and "forced fault running" in second.text, second.text
            third = client.post("/v1/completions", json=body, headers=auth)
            assert third.status_code == 200 and third.json()["usage"]["completion_tokens"] == 4, third.text
            with client.stream("POST", "/v1/chat/completions", headers=auth, json={
                    "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": True}) as resp:
                assert resp.status_code == 200 and b"[DONE]" in resp.read()
        _wait_for_line(logs["workers"], b'"job_finished"')
        _wait_for_line(logs["housekeeping"], b"cron:sweep failed")
    finally:
        stop_all(procs)

    _, api_message = _forced_error(logs["api"], lambda x: x.get("event") == "unhandled_error")
    _, worker_message = _forced_error(logs["workers"], lambda x: x.get("event") == "job_failed")
    sweep, sweep_message = _forced_error(logs["housekeeping"], lambda x: "cron:sweep failed" in x.get("event", ""))
    # The messages that quote a request are hidden; the one that quotes the Settings (arq's
    # failure line repeats it whole) shows them masked: the mask, not luck, keeps them out.
    assert api_message == worker_message == HIDDEN_MESSAGE
    assert sweep_message.startswith("forced fault sweeping with Settings(redis_url='redis://:***@127.0.0.1:")
    assert "webhook_secret='***'" in sweep["event"] and "api_keys='***'" in sweep["event"]
    for name, log in logs.items():
        raw = log.read_bytes()
        found = {value: raw.count(value.encode()) for value in PLANTED if value.encode() in raw}
        assert not found, f"{name} logged planted values {found}"
        longest = max(len(line) for line in raw.splitlines())
        assert longest < MAX_LINE, f"{name} logged a {longest}-byte line"
