"""`make run` keeps serving through an engine death: the README's first command, run as a
newcomer runs it (its embedded Redis aside: LLMQ_REDIS_URL points it at the suite's), its worker's
vLLM engine SIGKILLed mid-stream. Before, the worker exited and honcho stopped the whole stack."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.conftest import REPO, free_port
from tests.support.engine_faults import Faulty, kill_engine_mid_stream, rank_pids
from tests.support.processes import spawn_logged

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

READY_S = 420  # the model build, and an engine loading and warming up on 2 shared cores


@contextlib.contextmanager
def make_run(redis_url: str, log: Path, **settings: str) -> Iterator[Faulty]:
    """`make run` with ``settings`` (``LLMQ_*``), until it says it is ready; stopped after."""
    port = free_port()
    prefix = f"mkrun-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_PORT": str(port),
           "LLMQ_LOG_JSON": "true", "LLMQ_HEARTBEAT_S": "1", **settings}
    proc = spawn_logged(["make", "run"], log, cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while b"llmq is ready" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(1)
        with Redis.from_url(redis_url) as redis:
            yield Faulty(f"http://127.0.0.1:{port}", redis, Keys(prefix), load_settings({}).model_name, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # make, honcho and what honcho started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def made(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    with make_run(redis_url, tmp_path_factory.mktemp("make-run") / "make-run.log") as stack:
        yield stack


def test_make_run_serves_on_when_its_engine_is_killed_mid_stream(made, figures):
    kill_engine_mid_stream(made, figures, salt=7)  # the worker lives on: honcho stopped nothing


def test_make_run_with_two_ranks_serves_on_a_2_core_box(redis_url, tmp_path):
    """`LLMQ_TENSOR_PARALLEL_SIZE=2 make run`: an engine of two ranks, a core each (docs/operations.md#sizing),
    streamed as answered. A rank's death mid-stream is tests/e2e/test_parallel.py's."""
    with make_run(redis_url, tmp_path / "make-run.log", LLMQ_TENSOR_PARALLEL_SIZE="2") as made:
        [key] = list(made.redis.scan_iter(match=made.keys.worker("*")))
        assert json.loads(made.redis.hget(key, "parallel")) == {"tensor": 2, "pipeline": 1, "nodes": 1}
        assert len(rank_pids(made)) == 2, "one engine core, and a process per rank"
        body = {"prompt": "Hello", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        answered = httpx.post(f"{made.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with httpx.stream("POST", f"{made.url}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == answered
