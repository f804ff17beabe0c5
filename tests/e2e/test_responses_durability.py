"""A background Response outlives the web process that accepted it and the worker that ran it.

Real processes started by honcho from the repo's ``Procfile`` on a fresh prefix: two ``web``
processes on two ports and two ``worker``s (vLLM on the tiny model), each in a formation of its
own so one can be killed without honcho stopping the others (tests/e2e/test_fast_failover.py).
With the ``openai`` SDK:

1. the uninterrupted reference: a plain greedy ``responses.create``, alone on its worker;
2. the same request with ``background=True, stream=True`` on web A, read until its job has
   logged some tokens;
3. SIGKILL web A (the client's stream breaks) and the worker running the job;
4. ``responses.retrieve(id, stream=True, starting_after=N)`` on web B, N the last event the
   client saw.

The client has then seen every event exactly once (sequence numbers 0..end, each once), the
deltas add up to the reference's text, and the peer worker continued the job (attempt 2) from its
published tokens rather than starting over.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.conftest import free_port
from tests.support.event_log import ended_record, logged_events
from tests.support.procfile import BIN, kill_leftovers, start_honcho
from tests.support.real_processes import stop_all, tail, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(900)]

# Greedy on CPU is the same run only short of the float drift first seen at token 112
# (tests/e2e/test_procfile_drain.py); the prompt's greedy answer runs to this budget.
MAX_TOKENS = 96
KILL_AFTER_TOKENS = 12
PROMPTS = ["Once upon a time", "Tell me a story about a dragon.", "List the days of the week.",
           "Describe the sea.", "Count from one to fifty."]


@dataclass
class Stack:
    urls: dict[str, str]
    redis: Redis
    keys: Keys
    model: str
    procs: dict[str, tuple[object, Path]]

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{tail(log)}" for _, log in self.procs.values())

    def client(self, web: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[web]}/v1", api_key="x", max_retries=0, timeout=120)

    def logged_tokens(self, job_id: str) -> int:
        events = logged_events(self.redis, self.keys, self.model, job_id)
        return sum(len(d.get("token_ids") or []) for _, event in events for d in event.get("deltas") or [])

    def session_of(self, formation: str, program: str) -> int:
        """The pid of the shell honcho started for ``program`` (it leads a session holding the python)."""
        log = self.procs[formation][1].read_text(errors="replace")
        for line in log.splitlines():
            if f"{program}.1" in line and "started (pid=" in line:
                return int(line.rsplit("pid=", 1)[1].split(")")[0])
        raise AssertionError(f"no {program} pid in {formation}'s log\n{log[-2000:]}")


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("responses-durability")
    prefix = f"respdur-{uuid.uuid4().hex[:6]}"
    ports = {"web-a": free_port(), "web-b": free_port()}
    base = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_MAX_NUM_SEQS": "4",
            "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1", "LLMQ_LOG_JSON": "true",
            "LLMQ_DEVICE_LOCK_DIR": str(logs / "locks")}
    procs: dict[str, tuple[object, Path]] = {}
    for name, program in (("web-a", "web"), ("web-b", "web"), ("worker-a", "worker"), ("worker-b", "worker")):
        env = {**base, "LLMQ_PORT": str(ports.get(name, free_port()))}
        log = logs / f"honcho-{name}.log"
        procs[name] = (start_honcho([program], env, log), log)
    redis = Redis.from_url(redis_url)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        wait_ready(urls["web-a"], list(procs.values()), 2)
        wait_ready(urls["web-b"], list(procs.values()), 2)
        yield Stack(urls, redis, Keys(prefix), load_settings({}).model_name, procs)
    finally:
        stop_all(list(procs.values()))
        kill_leftovers([log for _, log in procs.values()])
        redis.close()


@dataclass
class Seen:
    events: list = field(default_factory=list)
    error: BaseException | None = None


def _read(stream, seen: Seen) -> None:
    try:
        for event in stream:
            seen.events.append(event)
    except BaseException as exc:  # noqa: BLE001 - the broken stream is the point; checked below
        seen.error = exc


def test_a_background_response_survives_its_web_process_and_its_worker(stack: Stack):
    b = stack.client("web-b")
    kwargs: dict = {}
    for prompt in PROMPTS:  # one whose greedy answer runs to the budget, so there is a middle to kill in
        kwargs = dict(model=stack.model, input=prompt, temperature=0, max_output_tokens=MAX_TOKENS)
        reference = b.responses.create(**kwargs)
        if reference.usage.output_tokens == MAX_TOKENS:
            break
    else:
        pytest.fail(f"no prompt ran to {MAX_TOKENS} tokens: {reference.usage}")

    workers = {stack.keys.worker_id(key.decode()): int(stack.redis.hget(key, "pid"))
               for key in stack.redis.scan_iter(match=stack.keys.worker("*")) if stack.redis.hget(key, "pid")}
    known = {key.decode() for key in stack.redis.scan_iter(match=stack.keys.job(stack.model, "*"), count=1000)}
    seen = Seen()
    stream = stack.client("web-a").responses.create(**kwargs, background=True, stream=True)
    reader = threading.Thread(target=_read, args=(stream, seen), daemon=True)
    reader.start()
    # The job's own log says when it is mid-way (the client's thread may read in bursts); its
    # worker is stopped at once (the engine makes a token every few ms), killed below.
    deadline = time.monotonic() + 120
    job_id = worker_pid = None
    while worker_pid is None:
        assert time.monotonic() < deadline and seen.error is None, f"{seen.error}\n{stack.tails()}"
        if job_id is None:  # the one job on this prefix that is not the reference
            for key in stack.redis.scan_iter(match=stack.keys.job(stack.model, "*"), count=1000):
                if key.decode() not in known:
                    job_id = key.decode().rsplit(":", 1)[-1]
        elif stack.logged_tokens(job_id) >= KILL_AFTER_TOKENS:
            assert stack.redis.hget(stack.keys.job(stack.model, job_id), "status") == b"running", \
                "the job ended before it could be stopped mid-way"
            worker_pid = workers[stack.redis.hget(stack.keys.job(stack.model, job_id), "worker").decode()]
            os.kill(worker_pid, signal.SIGSTOP)
        time.sleep(0.001)
    while not seen.events:  # what web A relayed before the stop reaches the client
        assert time.monotonic() < deadline and seen.error is None, f"{seen.error}\n{stack.tails()}"
        time.sleep(0.005)
    time.sleep(0.2)
    os.killpg(stack.session_of("web-a", "web"), signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the client's stream did not break when its web process died"
    assert seen.error is not None, "the client's stream ended by itself: the kill came too late"
    response_id = seen.events[0].response.id
    assert response_id == f"resp_{job_id}"
    before = list(seen.events)
    last = before[-1].sequence_number

    after = list(b.responses.retrieve(response_id, stream=True, starting_after=last))
    events = before + after
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events))), (numbers[:5], numbers[-5:], last)
    # Counted in text, not events: a flusher behind the engine merges a job's steps into one delta
    # (shared/chunking.py), so a loaded peer sends fewer, longer ones (a loaded run read 18 deltas).
    resumed = "".join(e.delta for e in after if e.type == "response.output_text.delta")
    assert len(resumed) >= len(reference.output_text) // 2, "most of the text must come after the kill, from the peer"
    assert events[-1].type == "response.incomplete"  # stopped by max_output_tokens, as the reference
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reference.output_text
    assert events[-1].response.output_text == reference.output_text
    assert b.responses.retrieve(response_id).output_text == reference.output_text
    final = ended_record(stack.redis, stack.keys, stack.model, job_id)
    assert final[b"status"] == b"done" and int(final[b"attempt"]) == 2  # continued by the peer
