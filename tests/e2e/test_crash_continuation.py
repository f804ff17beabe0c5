"""SIGKILL the worker that is streaming a job: a peer continues it, and the client's stream is
one seamless greedy run (real processes, real vLLM on the tiny model).

This module starts its own small stack (two workers, one API) on a fresh prefix with a short
lease, so a dead worker's job is taken over within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import GROUP, Keys
from tests.conftest import free_port
from tests.e2e.conftest import _spawn, _tail, stop_all, wait_ready
from tests.faults import alive, children

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

LEASE_S = 3
MAX_TOKENS = 200
BODY = {"inputs": "Once upon a time", "parameters": {"do_sample": False, "max_new_tokens": MAX_TOKENS,
                                                     "ignore_eos_token": True, "details": True}}


class Small:
    def __init__(self, url: str, prefix: str, redis_url: str, procs: list, logs: Path) -> None:
        self.url, self.prefix, self.redis_url, self.procs, self.logs = url, prefix, redis_url, procs, logs

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{_tail(log)}" for _, log in self.procs)


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    logs = tmp_path_factory.mktemp("crash-logs")
    prefix = f"crash-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_LEASE_S": str(LEASE_S)}
    procs: list[tuple[subprocess.Popen, Path]] = []
    for i in range(2):
        log = logs / f"worker{i}.log"
        procs.append((_spawn(["-m", "workers"], env, log), log))
    port = free_port()
    log = logs / "api.log"
    procs.append((_spawn(["-m", "api"], {**env, "LLMQ_PORT": str(port)}, log), log))
    stack = Small(f"http://127.0.0.1:{port}", prefix, redis_url, procs, logs)
    try:
        wait_ready(stack.url, procs, 2)
        yield stack
    finally:
        stop_all(procs)


def test_sigkill_mid_stream_continues_on_a_peer_identical_to_an_uninterrupted_run(small, figures):
    model = load_settings({}).model_name
    keys = Keys(small.prefix)
    redis = Redis.from_url(small.redis_url)
    with httpx.Client(timeout=120) as client:
        reference = client.post(f"{small.url}/invocations", json=BODY)
        assert reference.status_code == 200, reference.text
        want = [t["id"] for t in reference.json()["details"]["tokens"]]
        assert len(want) == MAX_TOKENS

        lines: list[tuple[float, dict]] = []  # (arrival time, line)
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                with client.stream("POST", f"{small.url}/invocations", json={**BODY, "stream": True}) as resp:
                    assert resp.status_code == 200
                    for raw in resp.iter_lines():
                        if raw:
                            lines.append((time.monotonic(), json.loads(raw)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                failure.append(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        # Find the job (the only running one on this prefix) once ~30 tokens are out, and its worker.
        deadline = time.monotonic() + 120
        job_key = worker = None
        while time.monotonic() < deadline:
            for key in redis.scan_iter(match=keys.job(model, "*")):
                fields = redis.hgetall(key)
                if fields.get(b"status") == b"running" and len(lines) >= 30:
                    job_key, worker = key, fields[b"worker"].decode()
            if job_key:
                break
            time.sleep(0.02)
        assert job_key, f"no running job found\n{small.tails()}"
        pid = int(redis.hget(keys.worker(worker), "pid"))
        engine_pids = children(pid)  # vLLM's engine core, a forked child of the worker
        os.kill(pid, signal.SIGKILL)
        killed_at, streamed_before = time.monotonic(), len(lines)
        reader.join(180)
        assert not reader.is_alive() and not failure, f"{failure}\n{small.tails()}"

    ids = [line["token"]["id"] for _, line in lines if "token" in line]
    job_id = job_key.decode().rsplit(":", 1)[-1]
    record = redis.hgetall(job_key)
    events = redis.xrange(keys.events(model, job_id))
    seqs = [int(entry_id.split(b"-")[0]) for entry_id, _ in events]
    after = [t for t, _ in lines[streamed_before:]]
    recovery_s = (after[0] - killed_at) if after else float("nan")
    figures.requests_sent, figures.completed = 1, int(ids == want)
    figures.tokens_lost = max(0, len(want) - len(ids)) + sum(a != b for a, b in zip(ids, want, strict=False))
    figures.tokens_duplicated = max(0, len(ids) - len(want))
    figures.seconds["recovery_s"] = recovery_s
    print(f"killed after {streamed_before} lines; next token {recovery_s:.2f} s later (lease {LEASE_S} s)")

    assert streamed_before < MAX_TOKENS, "the kill must land mid-stream"
    assert ids == want, "the continued stream equals an uninterrupted greedy run: nothing lost or repeated"
    assert lines[-1][1]["generated_text"] == reference.json()["generated_text"]
    assert record[b"status"] == b"done" and record[b"attempt"] == b"2"
    assert record[b"worker"].decode() != worker
    assert seqs == list(range(1, len(seqs) + 1))
    assert (redis.xpending(keys.queue(model), GROUP))["pending"] == 0
    assert recovery_s < LEASE_S + 15  # lease + one blocking read + a continuation prefill, generously
    # The dead worker's engine went with it (workers/lifeline.py), not left running as an orphan.
    assert engine_pids, "the worker's engine process was not found"
    assert not [p for p in engine_pids if alive(p)], "the SIGKILLed worker left its engine running"
    redis.close()
