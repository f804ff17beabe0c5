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

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.e2e.conftest import one_worker
from tests.e2e.procfile import Stream, log_events
from tests.support.event_log import ended_record, logged_events
from tests.support.faults import Figures, alive, children
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

KILL = {"X-LLMQ-Test-Fault": "kill-engine"}
PROMPT_IDS = [1, 245, 92, 311, 48, 203, 77, 130]  # a prompt as token ids: the reference extends it exactly
MAX_TOKENS = 900  # ~2 s of tokens here: the others still stream when the killer arrives


@dataclass
class Faulty:
    url: str
    redis: Redis
    keys: Keys
    model: str
    log: Path

    def worker_pid(self) -> int:
        [key] = list(self.redis.scan_iter(match=self.keys.worker("*")))
        return int(self.redis.hget(key, "pid"))

    def worker_events(self, event: str) -> list[dict]:
        """The worker's log records of ``event`` (make run's log is honcho's, every process's)."""
        return log_events(self.log.read_text(errors="replace"), event)


@pytest.fixture(scope="module")
def faulty(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    logs = tmp_path_factory.mktemp("engine-faults-logs")
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1", "LLMQ_LEASE_S": "3",
           "LLMQ_TEST_FAULTS": "true", "LLMQ_ENGINE_RESTARTS": "10"}  # the module kills four engines
    with one_worker(env, logs) as url, Redis.from_url(redis_url) as redis:
        yield Faulty(url, redis, Keys(prefix), load_settings({}).model_name, logs / "worker.log")


def streamed(url: str, salt: int) -> Stream:
    """A greedy completions stream of ``MAX_TOKENS`` from ``PROMPT_IDS`` + ``salt``, read on a thread."""
    stream = Stream(url, [*PROMPT_IDS, 100 + salt], MAX_TOKENS)  # type: ignore[arg-type]  # ids: a prompt too
    stream.thread.start()
    return stream


def logged_tokens(f: Faulty, job_id: str) -> int:
    events = logged_events(f.redis, f.keys, f.model, job_id)
    return sum(len(d.get("token_ids") or []) for _, e in events for d in e.get("deltas") or [])


def running_job(f: Faulty, stream: Stream, tokens: int) -> None:
    """Until ``stream``'s job has logged ``tokens`` tokens."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if stream.job_id and logged_tokens(f, stream.job_id) >= tokens:
            return
        assert not stream.errors, stream.errors
        time.sleep(0.01)
    raise AssertionError(f"the stream never reached {tokens} tokens")


def result_ids(f: Faulty, job_id: str) -> list[int]:
    record = ended_record(f.redis, f.keys, f.model, job_id)
    assert record[b"status"] == b"done", record.get(b"error")
    [choice] = json.loads(record[b"result"])["choices"]
    return choice["token_ids"]


def greedy_ids(f: Faulty, prompt: list[int], max_tokens: int) -> list[int]:
    """A greedy completion run alone, as token ids (from its job's stored result)."""
    resp = httpx.post(f"{f.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True}, timeout=300)
    assert resp.status_code == 200, resp.text
    return result_ids(f, resp.json()["id"].removeprefix("cmpl-"))


def check_exact(f: Faulty, stream: Stream, figures: Figures | None = None) -> None:
    """Streamed once, whole, and after the death the greedy continuation of what was published."""
    stream.thread.join(300)
    assert not stream.thread.is_alive()
    assert not stream.errors and stream.done and stream.finish_reasons == ["length"], (stream.errors, stream.text)
    assert len(stream.tokens) == MAX_TOKENS
    ids = result_ids(f, stream.job_id)
    assert len(ids) == MAX_TOKENS
    record = ended_record(f.redis, f.keys, f.model, stream.job_id)
    assert record[b"attempt"] == b"1", "a rebuild is not a failed delivery: the same attempt continued"
    seqs = [seq for seq, _ in logged_events(f.redis, f.keys, f.model, stream.job_id)]
    assert seqs == list(range(1, len(seqs) + 1)), "every event once, in order"
    [continued] = [e for e in f.worker_events("job_continued") if e["job_id"] == stream.job_id]
    emitted = continued["emitted"]
    assert 0 < emitted < MAX_TOKENS, "the death came mid-stream"
    rest = greedy_ids(f, list(stream.prompt) + ids[:emitted], MAX_TOKENS - emitted)
    lost = sum(a != b for a, b in zip(rest, ids[emitted:], strict=True))
    if figures is not None:
        figures.requests_sent += 1
        figures.completed += int(not lost)
        figures.tokens_lost += lost
    assert ids[emitted:] == rest, "the continuation is the greedy run from the published tokens"


def engine_pid(f: Faulty) -> int:
    [pid] = [p for p in children(f.worker_pid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()
             or "EngineCore" in Path(f"/proc/{p}/comm").read_text()]
    return pid


def dead_lettered(f: Faulty) -> list[str]:
    return [fields[b"job"].decode() for _, fields in f.redis.xrange(f.keys.dead(f.model))]


def in_dead_letters(f: Faulty, job_id: str) -> bool:
    """Whether ``job_id`` reaches the dead-letter stream: written with its record, a moment after
    its end is logged (what its client has seen: docs/architecture.md)."""
    eventually_sync(lambda: job_id in dead_lettered(f), timeout_s=10, interval_s=0.05,
                    what=f"{job_id} in the dead-letter stream")
    return True


def answered(f: Faulty) -> None:
    resp = httpx.post(f"{f.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
    assert resp.status_code == 200, resp.text


def kill_engine_mid_stream(f: Faulty, figures: Figures, salt: int) -> tuple[Stream, int]:
    """SIGKILL the worker's engine once a stream has 20 tokens; the stream must end exact, its
    worker the same process, serving the next request. Returns the stream and the dead engine's pid."""
    worker = f.worker_pid()
    stream = streamed(f.url, salt)
    running_job(f, stream, 20)
    engine = engine_pid(f)
    os.kill(engine, signal.SIGKILL)
    killed_at = time.monotonic()
    stream.thread.join(300)
    figures.seconds["stream_done_after_kill_s"] = time.monotonic() - killed_at
    check_exact(f, stream, figures)
    assert f.worker_pid() == worker and alive(worker), "the same worker process"
    assert not alive(engine)
    answered(f)
    return stream, engine


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
