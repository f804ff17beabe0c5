"""A redis-server with AOF persistence that a test can stop and start again: what a Redis
restart does to the queue (tests/integration/test_redis_restart.py, test_fast_takeover.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shared.redis import redis_server_binary
from tests.conftest import free_port, wait_for_ping

__all__ = ["AofRedis"]


class AofRedis:
    """A redis-server with appendfsync always, restartable on the same port and data directory."""

    def __init__(self, data: Path) -> None:
        self.data, self.port = data, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL,
        )
        wait_for_ping(self.url)

    def stop(self) -> None:
        assert self.proc is not None, "stop() before start()"
        self.proc.terminate()  # SIGTERM: redis-server fsyncs the AOF and exits
        self.proc.wait(10)
