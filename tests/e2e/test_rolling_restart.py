"""A rolling restart of every worker while clients keep sending: nothing refused, lost or doubled.

Real processes: one API and two workers (vLLM on the tiny model). Two clients stream greedy
completions back to back the whole time. Both workers get SIGTERM, one after the other, each
while a job runs, with a drain of 0 s, so each hands back at once what it is running; for a
while no worker exists at all, then two fresh ones start. Every request must complete with
exactly the tokens of an uninterrupted run of its prompt: requests sent during the gap wait in
the queue, and jobs handed back mid-stream continue on the fresh workers from their published
tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis import Redis

from shared.keys import Keys
from tests.conftest import free_port
from tests.support.faults import lost_and_duplicated
from tests.support.real_processes import spawn, stop_all, tail, wait_ready
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(1200)]

# Short generations: greedy output on CPU drifts with batch composition past ~110 tokens (see
# tests/e2e/test_procfile_drain.py), and the references run alone.
MAX_TOKENS = 40
PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning", "Hello, my name is"]
CLIENTS = 2


def _body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "stream": True}


@dataclass
class Outcome:
    prompt: str
    sent_at: float
    status: int = 0
    tokens: list[str] = field(default_factory=list)
    errors: list[object] = field(default_factory=list)
    done: bool = False


def _stream(client: httpx.Client, url: str, prompt: str) -> Outcome:
    out = Outcome(prompt, time.monotonic())
    try:
        with client.stream("POST", f"{url}/v1/completions", json=_body(prompt)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.errors.append(resp.read().decode())
                return out
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        out.errors.append(chunk["error"])
                    for choice in chunk.get("choices", []):
                        out.tokens += (choice.get("logprobs") or {}).get("tokens") or []
    except Exception as exc:  # noqa: BLE001 - reported by the assertions
        out.errors.append(repr(exc))
    return out


def _until_a_job_runs(redis: Redis, prefix: str, timeout_s: float = 30) -> None:
    pattern = Keys(prefix).job("*", "*")

    def runs() -> bool:
        return any(redis.hget(k, "status") == b"running" for k in redis.scan_iter(match=pattern, count=1000))
    eventually_sync(runs, timeout_s=timeout_s, interval_s=0.005, what="a job to run")


def test_a_rolling_restart_of_every_worker_refuses_loses_and_doubles_nothing(redis_url, tmp_path: Path, figures):
    figures.scenario = "rolling restart: SIGTERM both workers in turn, a gap with none, two fresh ones"
    prefix = f"roll-{uuid.uuid4().hex[:6]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_PORT": str(port),
           "LLMQ_LOG_JSON": "true", "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024",
           "LLMQ_HEARTBEAT_S": "1", "LLMQ_DRAIN_TIMEOUT_S": "0", "LLMQ_SSE_KEEPALIVE_S": "2"}
    procs: list[tuple[subprocess.Popen, Path]] = []

    def worker(name: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        procs.append((spawn(["-m", "workers"], env, log), log))
        return procs[-1][0]

    log = tmp_path / "api.log"
    procs.append((spawn(["-m", "api"], env, log), log))
    first = [worker("worker-a"), worker("worker-b")]
    redis = Redis.from_url(redis_url)
    try:
        wait_ready(url, procs, 2)
        with httpx.Client(timeout=httpx.Timeout(30, read=600)) as client:
            reference = {p: _stream(client, url, p).tokens for p in PROMPTS}
            assert all(len(t) == MAX_TOKENS for t in reference.values()), reference

            outcomes: list[Outcome] = []
            stop = threading.Event()

            def send(offset: int) -> None:
                i = offset
                while not stop.is_set():
                    outcomes.append(_stream(client, url, PROMPTS[i % len(PROMPTS)]))
                    i += 1

            clients = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(CLIENTS)]
            for t in clients:
                t.start()
            time.sleep(3)
            stopped = []
            for p in first:  # one after the other: the second stops while the first's jobs moved to it
                # Mid-stream: a job is running (on the one worker left, the second time), so the
                # drain has something to hand back. Jobs run a fraction of a second: poll fast.
                _until_a_job_runs(redis, prefix)
                p.send_signal(signal.SIGTERM)
                assert p.wait(60) == 0, "a drained worker exits 0"
                stopped.append(time.monotonic())
            procs[:] = [(p, log) for p, log in procs if p not in first]  # gone on purpose
            # No worker at all: requests keep arriving (two more clients send one each, so some
            # surely start in the gap) and wait in the queue.
            late = [threading.Thread(target=lambda p=p: outcomes.append(_stream(client, url, p)), daemon=True)
                    for p in PROMPTS[:2]]
            for t in late:
                t.start()
            time.sleep(5)
            worker("worker-c")
            worker("worker-d")
            wait_ready(url, procs, 2)
            restarted_at = time.monotonic()
            time.sleep(3)
            stop.set()
            for t in clients + late:
                t.join(120)
            assert not any(t.is_alive() for t in clients + late), "a client never got its answer"
        handed_back = sum(bool(redis.hget(k, "handoffs")) for k in redis.scan_iter(match=Keys(prefix).job("*", "*")))
    finally:
        stop_all(procs)
        redis.close()

    refused = [o for o in outcomes if o.status != 200]
    failed = [o for o in outcomes if o.errors or not o.done]
    lost = dup = 0
    for o in outcomes:
        lost_o, dup_o = lost_and_duplicated(reference[o.prompt], o.tokens)
        lost, dup = lost + lost_o, dup + dup_o
    figures.requests_sent = len(outcomes)
    figures.completed = sum(o.done and not o.errors and o.tokens == reference[o.prompt] for o in outcomes)
    figures.ended_with_error = len(failed)
    figures.tokens_lost, figures.tokens_duplicated = lost, dup
    figures.jobs_lost = len(outcomes) - figures.completed - figures.ended_with_error
    figures.seconds["no_worker_s"] = restarted_at - stopped[-1]
    gap_sent = sum(stopped[-1] < o.sent_at < restarted_at for o in outcomes)
    print(f"{len(outcomes)} requests, {gap_sent} of them sent while no worker existed, {handed_back} handed "
          f"back mid-stream; no worker for {restarted_at - stopped[-1]:.1f} s")
    detail = "\n".join(f"--- {log.name}\n{tail(log)}" for _, log in procs)
    assert not refused, [(o.status, o.errors) for o in refused]
    assert not failed, ([(o.prompt, o.errors) for o in failed], detail)
    assert (lost, dup) == (0, 0)
    assert figures.completed == len(outcomes) >= 6
    assert gap_sent >= 2  # requests really were sent while no worker existed
    assert handed_back >= 1  # and a job really was handed back mid-stream, then continued
