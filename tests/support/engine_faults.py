"""A worker whose engine is killed under it, on real vLLM: the stack's handles (:class:`Faulty`), a
greedy stream on its own thread, and the checks that every other job stayed exact once its engine
was rebuilt in place (tests/e2e/test_engine_faults.py; tests/e2e/test_make_run.py does the same to
`make run`)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis import Redis

from shared.keys import Keys
from tests.support.event_log import ended_record, logged_events
from tests.support.faults import Figures, alive, children
from tests.support.procfile import Stream, log_events

__all__ = ["PROMPT_IDS", "MAX_TOKENS", "Faulty", "streamed", "running_job", "check_exact", "engine_pid", "rank_pids",
           "answered", "kill_engine_mid_stream", "greedy_ids"]

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


def check_exact(f: Faulty, stream: Stream, figures: Figures | None = None, *, attempt: int = 1) -> None:
    """Streamed once, whole, and after the death the greedy continuation of what was published;
    ``attempt``: the delivery that ended it (1: its worker survived, 2: a peer took it over)."""
    stream.thread.join(300)
    assert not stream.thread.is_alive()
    assert not stream.errors and stream.done and stream.finish_reasons == ["length"], (stream.errors, stream.text)
    assert len(stream.tokens) == MAX_TOKENS
    ids = result_ids(f, stream.job_id)
    assert len(ids) == MAX_TOKENS
    record = ended_record(f.redis, f.keys, f.model, stream.job_id)
    assert record[b"attempt"] == str(attempt).encode(), "a rebuild is not a failed delivery: the same attempt continued"
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


def rank_pids(f: Faulty) -> list[int]:
    """The engine's rank processes (an engine of several ranks: vLLM titles them VLLM::Worker_TP0 ...)."""
    return sorted(p for p in children(engine_pid(f))
                  if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"VLLM::Worker"))


def engine_pid(f: Faulty) -> int:
    [pid] = [p for p in children(f.worker_pid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()
             or "EngineCore" in Path(f"/proc/{p}/comm").read_text()]
    return pid


def answered(f: Faulty) -> None:
    resp = httpx.post(f"{f.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
    assert resp.status_code == 200, resp.text


def kill_engine_mid_stream(f: Faulty, figures: Figures, salt: int,
                           victim: Callable[[Faulty], int] = engine_pid) -> tuple[Stream, int]:
    """SIGKILL the worker's engine (``victim``: a process of it, by default its core) once a stream
    has 20 tokens; the stream must end exact, its worker the same process, serving the next request.
    Returns the stream and the dead engine's pid.

    The engine is paused (SIGSTOP) before the kill, and the stream checked to be mid-way: on a
    loaded box the engine's ranks can starve this process long enough for the whole stream to end
    before the kill lands, and a kill after the stream kills an idle engine, whose death the next
    test then sees. A stream that ended first is let go, and another one tried."""
    worker, engine, target = f.worker_pid(), engine_pid(f), victim(f)  # before: a /proc scan takes a while
    frozen = [engine, *children(engine)]
    for attempt in range(3):
        stream = streamed(f.url, salt + 50 * attempt)
        running_job(f, stream, 20)
        _signal(frozen, signal.SIGSTOP)
        if _mid_way(f, stream):
            break
        _signal(frozen, signal.SIGCONT)
        stream.thread.join(300)
    else:
        raise AssertionError("every stream ended before its engine could be paused")
    os.kill(target, signal.SIGKILL)
    killed_at = time.monotonic()
    _signal([pid for pid in frozen if pid != target], signal.SIGCONT)
    stream.thread.join(300)
    figures.seconds["stream_done_after_kill_s"] = time.monotonic() - killed_at
    check_exact(f, stream, figures)
    assert f.worker_pid() == worker and alive(worker), "the same worker process"
    assert not alive(engine)
    answered(f)
    return stream, engine


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def _mid_way(f: Faulty, stream: Stream) -> bool:
    """With the engine paused: whether ``stream``'s job still has tokens to come. What the engine
    made before the pause reaches the log within the settling time (the worker is not paused)."""
    time.sleep(0.5)
    return logged_tokens(f, stream.job_id) < MAX_TOKENS - 10 and not stream.done
