"""A small stack of real processes (two workers, one API) with a short lease, and the helpers that
stream a job, SIGKILL its worker mid-stream and check that a peer continued it exactly: the
crash-continuation tests (tests/e2e/test_crash_continuation.py) and the e2e tests that reuse their
stack (tracing, adapters)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx
from redis import Redis

from shared.config import load_settings
from shared.keys import GROUP, Keys
from tests.conftest import free_port
from tests.support.event_log import ended_record, logged_events, still_running
from tests.support.faults import Figures, alive, children, lost_and_duplicated
from tests.support.real_processes import ready_pids, spawn, stop_all, tail, wait_ready

__all__ = ["LEASE_S", "KILL_AFTER_TOKENS", "Small", "small_stack", "Items", "json_lines", "sse_events", "Killed",
           "stream_and_kill", "check_taken_over", "result_ids", "Choices", "completions_tokens", "compare_completions"]

LEASE_S = 3
KILL_AFTER_TOKENS = 20  # logged, over the job's choices (an event carries one step or several)


class Small:
    def __init__(self, url: str, prefix: str, redis_url: str, procs: list, logs: Path, env: dict) -> None:
        self.url, self.prefix, self.procs, self.logs, self.env = url, prefix, procs, logs, env
        self.redis = Redis.from_url(redis_url)
        self.keys = Keys(prefix)
        self.model = load_settings({}).model_name
        self.spawned = 2

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{tail(log)}" for _, log in self.procs)

    def ready_pids(self) -> set[int]:
        return ready_pids(self.redis, self.keys)

    def two_workers(self) -> None:
        """Replace the worker an earlier test killed, and wait until both serve."""
        self.procs[:] = [(p, log) for p, log in self.procs if p.poll() is None]
        workers = [p for p, log in self.procs if log.name.startswith("worker")]
        for _ in range(2 - len(workers)):
            log = self.logs / f"worker{self.spawned}.log"
            self.spawned += 1
            proc = spawn(["-m", "workers"], self.env, log)
            self.procs.append((proc, log))
            workers.append(proc)
        deadline = time.monotonic() + 300
        while not {p.pid for p in workers} <= self.ready_pids():
            assert time.monotonic() < deadline and all(p.poll() is None for p in workers), self.tails()
            time.sleep(0.5)


@contextlib.contextmanager
def small_stack(redis_url: str, logs: Path, prefix: str, base_env: Mapping[str, str] = os.environ,
                **extra: str) -> Iterator[Small]:
    """Two workers and one API on ``prefix``, with ``base_env`` and ``extra`` (tests/e2e/test_tracing.py
    adds its exporter's settings)."""
    env = {**base_env, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_LEASE_S": str(LEASE_S), **extra}
    procs: list[tuple[subprocess.Popen, Path]] = []
    for i in range(2):
        log = logs / f"worker{i}.log"
        procs.append((spawn(["-m", "workers"], env, log), log))
    port = free_port()
    log = logs / "api.log"
    procs.append((spawn(["-m", "api"], {**env, "LLMQ_PORT": str(port)}, log), log))
    stack = Small(f"http://127.0.0.1:{port}", prefix, redis_url, procs, logs, env)
    try:
        wait_ready(stack.url, procs, 2)
        yield stack
    finally:
        stop_all(procs)
        stack.redis.close()


# --- streaming, killing, checking -----------------------------------------------------------

Items = list[tuple[float, dict]]  # (arrival time, one JSON line or SSE event)


def json_lines(client: httpx.Client, url: str, body: dict, items: Items) -> None:
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for raw in resp.iter_lines():
            if raw:
                items.append((time.monotonic(), json.loads(raw)))


def sse_events(client: httpx.Client, url: str, body: dict, items: Items) -> None:
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for raw in resp.iter_lines():
            if raw.startswith("data: ") and raw != "data: [DONE]":
                items.append((time.monotonic(), json.loads(raw.removeprefix("data: "))))


@dataclass
class Killed:
    items: Items
    job_id: str
    worker: str
    logged: int  # events in the job's log when its worker was killed
    before: int  # items the client had read by then (it may lag behind the log)
    recovery_s: float  # from the kill to the successor's first item
    engine_pids: list[int] = field(default_factory=list)


def stream_and_kill(small: Small, read: Callable[[Items], None], after: int = KILL_AFTER_TOKENS) -> Killed:
    """Run ``read`` in a thread; once the job (the only running one on this prefix) has logged
    ``after`` tokens, SIGKILL its worker (an event carries every step its worker made while its
    flusher was busy, so events are no count of tokens); return when the stream has ended. The job's log,
    not the client, says when: a client thread starved of CPU reads in bursts, and the job could
    finish before the kill."""
    items: Items = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            read(items)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            failure.append(exc)

    reader = threading.Thread(target=run)
    reader.start()
    deadline = time.monotonic() + 120
    job_id = worker = None
    logged = tokens = 0
    while tokens < after and time.monotonic() < deadline:
        if job_id is None:
            for key in small.redis.scan_iter(match=small.keys.job(small.model, "*"), count=1000):
                found = key.decode().rsplit(":", 1)[-1]
                # Not an earlier job whose end is logged and not yet in its record (a reference run's)
                if still_running(small.redis, small.keys, small.model, found):
                    job_id, worker = found, small.redis.hget(key, "worker").decode()
        if job_id is not None:
            events = logged_events(small.redis, small.keys, small.model, job_id)  # a stream, or the compact log
            logged = len(events)
            tokens = sum(len(d.get("token_ids") or []) for _, e in events for d in e.get("deltas") or [])
        time.sleep(0.005)
    assert job_id and tokens >= after, f"no running job found\n{small.tails()}"
    pid = int(small.redis.hget(small.keys.worker(worker), "pid"))
    engine_pids = children(pid)  # vLLM's engine core, a forked child of the worker
    os.kill(pid, signal.SIGKILL)
    killed_at, before = time.monotonic(), len(items)
    reader.join(180)
    assert not reader.is_alive() and not failure, f"{failure}\n{small.tails()}"
    # The successor's first item ends the longest silence after the kill (what the dead worker
    # published just before it died can still arrive first).
    stamps = [killed_at, *(t for t, _ in items[before:])]
    _, resumed = max(((b - a, b) for a, b in pairwise(stamps)), default=(0.0, float("nan")))
    return Killed(items, job_id, worker, logged, before, resumed - killed_at, engine_pids)


def check_taken_over(small: Small, killed: Killed) -> None:
    """The job finished on the peer, its log is one run of seqs, nothing is left pending, and
    the dead worker's engine went with it (workers/lifeline.py)."""
    record = ended_record(small.redis, small.keys, small.model, killed.job_id)
    assert record[b"status"] == b"done" and record[b"attempt"] == b"2", record
    assert record[b"worker"].decode() != killed.worker
    log = small.redis.xrange(small.keys.events(small.model, killed.job_id))
    seqs = [int(entry_id.split(b"-")[0]) for entry_id, _ in log]
    assert seqs == list(range(1, len(seqs) + 1))
    assert killed.logged < len(seqs) - 1, "the kill must land mid-stream"
    assert small.redis.xpending(small.keys.queue(small.model), GROUP)["pending"] == 0
    assert killed.recovery_s < LEASE_S + 15  # lease + one blocking read + a prefill or a replay, generously
    assert killed.engine_pids, "the worker's engine process was not found"
    assert not [p for p in killed.engine_pids if alive(p)], "the SIGKILLed worker left its engine running"


def result_ids(small: Small, job_id: str) -> list[list[int]]:
    """Each choice's token ids, from the job's stored result."""
    result = json.loads(ended_record(small.redis, small.keys, small.model, job_id)[b"result"])
    return [c["token_ids"] for c in result["choices"]]


@dataclass
class Choices:
    """An OpenAI completions stream, per choice index: text, tokens (``logprobs: 0``), finish."""

    text: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, list[str]] = field(default_factory=dict)
    errors: int = 0
    job_id: str = ""

    @classmethod
    def of(cls, items: Items) -> Choices:
        out = cls()
        for _, chunk in items:
            if "error" in chunk:
                out.errors += 1
                continue
            out.job_id = chunk["id"].removeprefix("cmpl-")
            for c in chunk["choices"]:
                i = c["index"]
                out.text[i] = out.text.get(i, "") + c["text"]
                out.tokens.setdefault(i, []).extend((c.get("logprobs") or {}).get("tokens") or [])
                if c.get("finish_reason"):
                    out.finish.setdefault(i, []).append(c["finish_reason"])
        return out


def completions_tokens(items: Items) -> int:
    return sum(len((c.get("logprobs") or {}).get("tokens") or []) for _, chunk in items
               for c in chunk.get("choices", []))


def compare_completions(small: Small, body: dict, figures: Figures) -> tuple[Choices, Choices]:
    """The same completions request alone, uninterrupted, then with its worker killed mid-stream:
    both streams must be identical per choice (text, tokens, finish), with no error event."""
    small.two_workers()
    url = f"{small.url}/v1/completions"
    body = {"model": small.model, "stream": True, "logprobs": 0, **body}
    with httpx.Client(timeout=120) as client:
        reference: Items = []
        sse_events(client, url, body, reference)
        killed = stream_and_kill(small, lambda items: sse_events(client, url, body, items))
    want, got = Choices.of(reference), Choices.of(killed.items)
    total = sum(len(t) for t in want.tokens.values())
    lost = dup = 0
    for i, tokens in want.tokens.items():
        lo, du = lost_and_duplicated(tokens, got.tokens.get(i, []))
        lost, dup = lost + lo, dup + du
    identical = (got.text, got.tokens, got.finish) == (want.text, want.tokens, want.finish)
    figures.requests_sent, figures.completed = 1, int(identical and not got.errors)
    figures.ended_with_error, figures.tokens_lost, figures.tokens_duplicated = got.errors, lost, dup
    figures.seconds["recovery_s"] = killed.recovery_s
    streamed = completions_tokens(killed.items[:killed.before])
    print(f"killed after {killed.logged} events ({streamed} of {total} tokens read); "
          f"next token {killed.recovery_s:.2f} s later (lease {LEASE_S} s)")

    assert not got.errors and not want.errors, "no error event: the job continued"
    assert got.tokens == want.tokens, "every choice's tokens: nothing lost, repeated or changed"
    assert got.text == want.text and got.finish == want.finish
    assert all(len(f) == 1 for f in got.finish.values()), "each choice finishes exactly once"
    assert result_ids(small, got.job_id) == result_ids(small, want.job_id), "the stored results agree by token id"
    check_taken_over(small, killed)
    return want, got
