"""The web process keeps idle connections open for LLMQ_HTTP_KEEPALIVE_S (default 75 s), not
uvicorn's 5 s: a load balancer in front (AWS ALB: 60 s idle) must always be the side that closes
an idle connection, or a request it sends on one llmq is just closing comes back as a 502.

Real ``python -m api`` processes (exactly as deployed: api/__main__.py builds the uvicorn server)
on real Redis, no worker; one raw TCP connection each, so "the same connection" is certain.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.waiting import eventually_sync

UVICORN_DEFAULT_S = 5
REQUEST = b"GET /v2/health/live HTTP/1.1\r\nHost: llmq\r\n\r\n"
START_TIMEOUT_S = 60


def _spawn_api(redis_url: str, log: Path, **settings: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LLMQ_HTTP_KEEPALIVE_S"}  # the default unless given
    env.update(LLMQ_REDIS_URL=redis_url, LLMQ_PREFIX=f"keepalive-{port}", LLMQ_HOST="127.0.0.1", LLMQ_PORT=str(port),
               LLMQ_SERVED_MODEL_NAME="tiny", LLMQ_LOG_JSON="true", **settings)
    proc = spawn_logged([sys.executable, "-m", "api"], log, cwd=REPO, env=env, start_new_session=True)
    return proc, port


def _wait_serving(proc: subprocess.Popen, port: int, log: Path) -> None:
    def live() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the API exited:\n{log.read_text(errors='replace')[-3000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=2) as resp:
            return resp.status == 200
    eventually_sync(live, timeout_s=START_TIMEOUT_S, interval_s=0.2, ignoring=(OSError,),
                    what=lambda: f"the API to start:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def apis(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """Two API processes, started together: the default setting, and LLMQ_HTTP_KEEPALIVE_S=1."""
    logs = tmp_path_factory.mktemp("keepalive")
    started = {"default": _spawn_api(redis_url, logs / "default.log"),
               "one_second": _spawn_api(redis_url, logs / "one_second.log", LLMQ_HTTP_KEEPALIVE_S="1")}
    try:
        for name, (proc, port) in started.items():
            _wait_serving(proc, port, logs / f"{name}.log")
        yield {name: port for name, (_, port) in started.items()}
    finally:
        for proc, _ in started.values():
            proc.terminate()
        for proc, _ in started.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _exchange(sock: socket.socket) -> bytes:
    """One request on ``sock`` and its whole response (the health body is small and has a length)."""
    sock.sendall(REQUEST)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection instead of answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(headers[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection mid-response"
        body += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    assert headers.get(b"connection") != b"close", head
    return body


def test_an_idle_connection_outlives_uvicorns_default_keepalive(apis):
    """Default settings (75 s): idle for longer than uvicorn's 5 s, the same connection answers."""
    with socket.create_connection(("127.0.0.1", apis["default"]), timeout=10) as sock:
        local = sock.getsockname()
        first = _exchange(sock)
        time.sleep(UVICORN_DEFAULT_S + 1)
        assert sock.getsockname() == local
        assert _exchange(sock) == first  # the same socket, still open, answers again


def test_llmq_http_keepalive_s_sets_when_an_idle_connection_is_closed(apis):
    """LLMQ_HTTP_KEEPALIVE_S=1: the server closes the idle connection after about a second, well
    before uvicorn's default would have."""
    with socket.create_connection(("127.0.0.1", apis["one_second"]), timeout=10) as sock:
        _exchange(sock)
        idle_from = time.monotonic()
        assert sock.recv(1) == b""  # blocks until the server closes (FIN): no byte ever comes
        idle_s = time.monotonic() - idle_from
    assert 0.5 <= idle_s < UVICORN_DEFAULT_S - 1, f"closed after {idle_s:.2f}s idle"
