"""arq's connection settings for the Redis URL llmq's own clients use (``LLMQ_ARQ_REDIS_URL``, else
``LLMQ_REDIS_URL``): arq reads a URL differently from redis-py, and shows the password."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from arq.connections import RedisSettings

from shared.config import MASK
from shared.redis import SentinelTarget, sentinel_target

__all__ = ["arq_redis_settings"]


class _RedisSettings(RedisSettings):
    """arq's settings, with a repr that masks the password (arq's own shows it)."""

    def __repr__(self) -> str:
        shown = {**self.__dict__, "password": MASK if self.password else self.password}
        return f"RedisSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def arq_redis_settings(dsn: str) -> RedisSettings:
    """arq's connection settings for the same URL llmq's own clients use (a Sentinel URL too:
    :func:`_arq_sentinel_settings`). arq's ``from_dsn``
    drops the query (a private CA's ``ssl_ca_certs``, ``ssl_check_hostname``, ...) and keeps a
    percent-encoded password encoded; redis-py reads both, so llmq does too."""
    sentinel = sentinel_target(dsn)
    if sentinel is not None:
        return _arq_sentinel_settings(sentinel)
    from_dsn = RedisSettings.from_dsn(dsn)
    base = _RedisSettings(**{f.name: getattr(from_dsn, f.name) for f in dataclasses.fields(from_dsn)})
    url = urlparse(dsn)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    changes: dict[str, Any] = {"username": unquote(url.username) if url.username else None,
                               "password": unquote(url.password) if url.password else None}
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
        if name in query:
            changes[name] = query[name]
    if "ssl_check_hostname" in query:
        changes["ssl_check_hostname"] = query["ssl_check_hostname"].lower() in ("1", "true", "yes", "on")
    return dataclasses.replace(base, **changes)


def _arq_sentinel_settings(target: SentinelTarget) -> RedisSettings:
    """arq's settings for a Sentinel URL. arq's Sentinel client (``create_pool``) passes on the
    Sentinels' addresses, the service, db, the data nodes' credentials and TLS on or off, and
    nothing else: a URL that needs more would connect without it, so it is refused at start-up."""
    options = target.node_options
    dropped = [f"sentinel_{name}" for name in target.sentinel_options]
    dropped += sorted(name for name in options if name.startswith("ssl_"))
    if dropped:
        raise ValueError(f"LLMQ_ARQ_REDIS_URL (LLMQ_REDIS_URL when unset): arq's Sentinel client cannot pass on "
                         f"{', '.join(dropped)}; give housekeeping a URL without them in LLMQ_ARQ_REDIS_URL")
    return _RedisSettings(host=list(target.sentinels), sentinel=True, sentinel_master=target.service,
                          database=options["db"], username=options.get("username"),
                          password=options.get("password"), ssl=options["ssl"])
