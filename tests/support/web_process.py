"""One ``python -m api`` on a free loopback port, with no worker: for the access tests, which need
the real entrypoint (its uvicorn options, its start-up checks) and no generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.waiting import eventually_sync

__all__ = ["Api", "api_env", "api_process", "stop"]

MODEL = "tiny"
GRACEFUL_S = 10  # api/__main__.py's: how long a stopping web process lets its streams run


@dataclass
class Api:
    proc: subprocess.Popen
    port: int
    log: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def api_env(redis_url: str, port: int, **settings: str) -> dict[str, str]:
    """The environment of a web process serving model ``tiny`` on ``port``, its own key prefix, no
    LLMQ_* setting of the caller's shell (no keys unless ``settings`` give some)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    return {**base, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": f"web-{port}", "LLMQ_HOST": "127.0.0.1",
            "LLMQ_PORT": str(port), "LLMQ_SERVED_MODEL_NAME": MODEL, "LLMQ_LOG_JSON": "true", **settings}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(GRACEFUL_S + 5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def api_process(redis_url: str, log: Path, command: Sequence[str] = ("-m", "api"), **settings: str) -> Iterator[Api]:
    """``python -m api`` (or ``command``) serving until /livez answers; stopped at the end. A host
    of ``0.0.0.0`` is reached on 127.0.0.1."""
    port = free_port()
    proc = spawn_logged([sys.executable, *command], log, cwd=REPO, env=api_env(redis_url, port, **settings),
                        start_new_session=True)
    api = Api(proc, port, log, settings.get("LLMQ_HOST", "127.0.0.1").replace("0.0.0.0", "127.0.0.1"))

    def serving() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the API exited ({proc.returncode}):\n{api.tail()}")
        try:
            return httpx.get(f"{api.url}/livez", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    try:
        eventually_sync(serving, timeout_s=60, interval_s=0.1, what=lambda: f"the API to serve:\n{api.tail()}")
        yield api
    finally:
        stop(proc)
