"""Real processes for the end-to-end tests: ``python -m workers`` and ``python -m api`` started with
their output in a log file, waited for until their workers serve, and stopped (tests/e2e/conftest.py
builds the session's stack with these; a module that needs settings of its own builds its own)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.waiting import eventually_sync

__all__ = ["READY_TIMEOUT_S", "spawn", "ready_workers", "ready_pids", "tail", "wait_ready", "stop_all", "one_worker"]

READY_TIMEOUT_S = 420  # two engines loading and warming up on 2 shared cores


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return spawn_logged([sys.executable, *args], log, cwd=REPO, env=env, start_new_session=True)


def ready_workers(url: str) -> int:
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


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def wait_ready(url: str, procs: list[tuple[subprocess.Popen, Path]], workers: int) -> None:
    """Until ``workers`` warm workers serve the API at ``url``; fails with every log's tail if a
    process dies or the engines take longer than READY_TIMEOUT_S."""
    def tails() -> str:
        return "\n".join(f"--- {log.name}\n{tail(log)}" for _, log in procs)

    def ready() -> bool:
        if dead := [log.name for p, log in procs if p.poll() is not None]:
            pytest.fail(f"stack did not become ready (dead: {dead})\n{tails()}")
        return ready_workers(url) >= workers
    eventually_sync(ready, timeout_s=READY_TIMEOUT_S, interval_s=1,
                    what=lambda: f"{workers} ready worker(s) at {url}\n{tails()}")


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
    procs = [(spawn(list(worker), env, logs / "worker.log"), logs / "worker.log"),
             (spawn(["-m", "api"], env, logs / "api.log"), logs / "api.log")]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs, 1)
        yield url
    finally:
        stop_all(procs)
