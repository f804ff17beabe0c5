"""A worker outlives its engine, on real vLLM: the engine killed from outside mid-stream, and a job
that kills its engine (``X-LLMQ-Test-Fault: kill-engine``, workers/faults.py: its step raises
inside vLLM's engine core, as vllm#16668's requests do) beside others and alone.

One worker and one API with LLMQ_TEST_FAULTS on, on a fresh prefix. Every other job must be
exact: streamed once, nothing lost or repeated, and after the death the greedy continuation of
what was published (the worker continues it alone, from its prompt's ids and its published
tokens; the reference runs the same request alone). Greedy output on CPU depends on the batch,
so that is what "exact" can mean for a job that shared its engine when it died
(tests/e2e/test_crash_continuation.py compares whole runs, each alone).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.support.engine_faults import (
    Faulty,
    answered,
    check_exact,
    engine_pid,
    kill_engine_mid_stream,
    running_job,
    streamed,
)
from tests.support.real_processes import one_worker
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

KILL = {"X-LLMQ-Test-Fault": "kill-engine"}


@pytest.fixture(scope="module")
def faulty(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    logs = tmp_path_factory.mktemp("engine-faults-logs")
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1", "LLMQ_LEASE_S": "3",
           "LLMQ_TEST_FAULTS": "true", "LLMQ_ENGINE_RESTARTS": "10"}  # the module kills four engines
    with one_worker(env, logs) as url, Redis.from_url(redis_url) as redis:
        yield Faulty(url, redis, Keys(prefix), load_settings({}).model_name, logs / "worker.log")


def dead_lettered(f: Faulty) -> list[str]:
    return [fields[b"job"].decode() for _, fields in f.redis.xrange(f.keys.dead(f.model))]


def in_dead_letters(f: Faulty, job_id: str) -> bool:
    """Whether ``job_id`` reaches the dead-letter stream: written with its record, a moment after
    its end is logged (what its client has seen: docs/architecture.md)."""
    eventually_sync(lambda: job_id in dead_lettered(f), timeout_s=10, interval_s=0.05,
                    what=f"{job_id} in the dead-letter stream")
    return True


def test_an_engine_killed_from_outside_mid_stream_is_rebuilt_in_place_and_the_stream_is_exact(faulty, figures):
    deaths = len(faulty.worker_events("engine_died"))
    stream, engine = kill_engine_mid_stream(faulty, figures, salt=1)
    [died] = faulty.worker_events("engine_died")[deaths:]
    assert died["cause"] == "killed", "a signal blames nobody"
    assert stream.job_id not in dead_lettered(faulty)
    assert engine_pid(faulty) != engine


def test_a_job_that_kills_its_engine_beside_others_is_dead_lettered_on_its_second_death_alone(faulty, figures):
    pid, deaths = faulty.worker_pid(), len(faulty.worker_events("engine_died"))
    others = [streamed(faulty.url, salt=s) for s in (2, 3)]
    for stream in others:
        running_job(faulty, stream, 10)
    killer = httpx.post(f"{faulty.url}/v1/completions", headers=KILL, timeout=300,
                        json={"prompt": "Kill the engine", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
    assert killer.status_code == 424, killer.text
    error = killer.json()["error"]
    assert error["code"] == 424 and "engine" in error["message"]
    for stream in others:
        check_exact(faulty, stream, figures)
    died = faulty.worker_events("engine_died")[deaths:]
    assert [(d["cause"], d["jobs"]) for d in died] == [("failed", 3), ("failed", 1)], \
        "the shared step, then the killer alone: no third death"
    killed_by = faulty.worker_events("engine_killed_by_job")[-1]
    assert killed_by["job_id"] not in {s.job_id for s in others}, "the killer, not a job beside it"
    assert in_dead_letters(faulty, killed_by["job_id"])
    assert not {s.job_id for s in others} & set(dead_lettered(faulty))
    assert faulty.worker_pid() == pid
    figures.requests_sent += 1  # the killer: ended with its clear error
    figures.ended_with_error += 1
    figures.counts["engine_deaths"] = len(died)
    answered(faulty)


def test_a_job_that_kills_its_engine_alone_is_dead_lettered_at_once_in_its_dialects_shape(faulty, figures):
    deaths = len(faulty.worker_events("engine_died"))
    client = anthropic.Anthropic(base_url=faulty.url, api_key="x", max_retries=0, timeout=300)
    with pytest.raises(anthropic.APIStatusError) as refused:
        client.messages.create(model=faulty.model, max_tokens=64, messages=[{"role": "user", "content": "Kill it"}],
                               extra_headers=KILL)
    assert refused.value.status_code == 424
    assert refused.value.body["type"] == "error" and "engine" in refused.value.body["error"]["message"]
    died = faulty.worker_events("engine_died")[deaths:]
    assert [(d["cause"], d["jobs"]) for d in died] == [("failed", 1)], "one engine, never a second"
    assert in_dead_letters(faulty, faulty.worker_events("engine_killed_by_job")[-1]["job_id"])
    figures.requests_sent, figures.ended_with_error = 1, 1
    figures.counts["engine_deaths"] = len(died)
    answered(faulty)


def test_an_unknown_fault_is_refused(faulty):
    resp = httpx.post(f"{faulty.url}/v1/completions", headers={"X-LLMQ-Test-Fault": "explode"},
                      json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 400 and "X-LLMQ-Test-Fault" in resp.json()["error"]["message"]
