"""Pointing llmq at a Redis Cluster: the URL spelling, the client it builds, and which pub/sub
commands each mode issues. No server needed (building a client opens no connection), but for
the one test of a node's connection opening, which opens one to a plain redis-server."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from api.listener import EventListener
from shared import scripts
from shared.cluster import sharded_pubsub
from shared.redis import _handshake, _Retry, cluster_target, connect


@pytest.mark.parametrize("url,seed", [
    ("redis+cluster://10.0.0.5:7000", "redis://10.0.0.5:7000"),
    ("rediss+cluster://user:pw@h:7000?ssl_ca_certs=/ca.pem", "rediss://user:pw@h:7000?ssl_ca_certs=/ca.pem"),
    ("REDIS+CLUSTER://h:7000/0", "redis://h:7000/0"),
    ("redis://h:6379/0", None),
    ("rediss://h:6379", None),
    ("unix:///tmp/redis.sock", None),
])
def test_cluster_urls_name_one_seed_node(url, seed):
    assert cluster_target(url) == seed


def test_a_cluster_url_builds_a_cluster_client_with_the_same_timeouts_retry_and_handshake():
    client = connect("redis+cluster://app:s3cret@127.0.0.1:7000", block_ms=3000)
    assert isinstance(client, RedisCluster)
    for kwargs in (client.connection_kwargs,
                   *(node.connection_kwargs for node in client.nodes_manager.startup_nodes.values())):
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"]) == (
            13.0, 5, 30)
        assert (kwargs["username"], kwargs["password"]) == ("app", "s3cret")
        assert isinstance(kwargs["retry"], _Retry)
        assert kwargs["redis_connect_func"] is _handshake
    assert list(client.nodes_manager.startup_nodes) == ["127.0.0.1:7000"]


def test_a_tls_cluster_url_keeps_its_query_options():
    client = connect("rediss+cluster://h:7000?ssl_ca_certs=/ca.pem&ssl_check_hostname=true")
    assert isinstance(client, RedisCluster)
    assert issubclass(client.connection_kwargs["connection_class"], SSLConnection)
    assert client.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert client.connection_kwargs["ssl_check_hostname"] is True


def test_a_cluster_has_no_databases():
    with pytest.raises(RedisClusterException):
        connect("redis+cluster://h:7000/2")


def test_a_plain_url_still_builds_a_single_server_client():
    client = connect("redis://h:6379/3")
    assert isinstance(client, Redis) and not isinstance(client, RedisCluster)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["db"], kwargs["socket_timeout"], kwargs["redis_connect_func"]) == (3, 12.0, _handshake)


async def test_a_single_server_always_uses_plain_pubsub_without_asking():
    # Port 1 answers nothing: any command would fail, so False comes without a round trip.
    assert await sharded_pubsub(Redis.from_url("redis://127.0.0.1:1/0")) is False


@pytest.mark.parametrize("script", [s for s in scripts.SCRIPTS if s.publishes], ids=lambda s: s.file)
def test_sharded_scripts_publish_the_live_channel_with_spublish_and_change_nothing_else(script):
    plain = scripts.source(script)
    sharded = scripts.sharded(plain)
    assert "redis.call('PUBLISH'" in plain and "redis.call('PUBLISH'" not in sharded
    assert sharded.replace("redis.call('SPUBLISH'", "redis.call('PUBLISH'") == plain


class FakeConnection:
    """Records what a listener sends; never answers."""

    is_connected = True

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    async def connect(self) -> None:
        pass

    async def send_command(self, *args, check_health: bool = True) -> None:
        self.sent.append(args)

    async def read_response(self, disconnect_on_error: bool = True):
        await asyncio.Event().wait()

    async def disconnect(self, nowait: bool = False) -> None:
        pass


@pytest.mark.parametrize("sharded,expected", [
    (False, [("SUBSCRIBE", b"home", b"job:a"), ("SUBSCRIBE", b"job:b"), ("UNSUBSCRIBE", b"job:b")]),
    (True, [("SUBSCRIBE", b"home"), ("SSUBSCRIBE", b"job:a"), ("SSUBSCRIBE", b"job:b"), ("SUNSUBSCRIBE", b"job:b")]),
])
async def test_the_listener_issues_plain_or_sharded_subscriptions(sharded, expected):
    listener = EventListener(Redis.from_url("redis://127.0.0.1:1/0"), "home", sharded=sharded)
    conn = FakeConnection()

    async def new_connection() -> FakeConnection:
        return conn

    listener._new_connection = new_connection
    listener._queues[b"job:a"] = set()  # followed before the connection: subscribed on connect
    task = asyncio.create_task(listener.run())
    try:
        while not conn.sent:
            await asyncio.sleep(0.01)
        async with listener.subscribe("job:b", wait=False) as queue:
            listener._dispatch([b"smessage" if sharded else b"message", b"job:b", b"event"])
            assert queue.get_nowait() == b"event"
    finally:
        task.cancel()
    assert conn.sent == expected


async def test_a_shard_dropping_a_followed_channel_is_subscribed_again():
    listener = EventListener(Redis.from_url("redis://127.0.0.1:1/0"), "home", sharded=True)
    conn = FakeConnection()
    listener._conn = conn
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    listener._queues[b"job:a"] = {queue}
    listener._dispatch([b"sunsubscribe", b"job:a", 0])  # the server's notice: the slot moved
    await asyncio.sleep(0)
    assert conn.sent == [("SSUBSCRIBE", b"job:a")]
    listener._dispatch([b"ssubscribe", b"job:a", 1])  # confirmed again: the log fills any gap
    assert queue.get_nowait() == b""


def test_the_cluster_clients_startup_nodes_never_run_dry():
    """redis-py drops a node from its startup nodes on each connection error (redis/redis-py#3693):
    a failover's cascade of errors would leave none, and the client could never reconnect."""
    cluster = connect("redis+cluster://127.0.0.1:7000")
    seeds = cluster.nodes_manager.startup_nodes
    [seed] = list(seeds.values())
    seeds["127.0.0.1:7001"] = other = type(seed)("127.0.0.1", 7001)  # discovered, as initialize() adds it
    seeds.pop("127.0.0.1:7000", None)  # redis-py's drop after a ConnectionError
    assert list(seeds) == ["127.0.0.1:7001"]
    seeds.pop("127.0.0.1:7001", None)  # the last one: every node it held comes back
    assert seeds == {"127.0.0.1:7000": seed, "127.0.0.1:7001": other}


@pytest.mark.parametrize("closed", ["while opening", "never"])
async def test_a_node_connection_closed_while_it_opens_ends_closed_not_open_and_unowned(
        redis_url, monkeypatch, closed):
    """A Cluster client re-reading its slots closes every node's connections and drops the nodes;
    redis-py's close skips a connection still opening, which then opened on a node nothing held
    and was collected open (an ``unclosed <StreamWriter>`` in a Cluster failover test)."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    cluster = connect(f"redis+cluster://127.0.0.1:{port}")
    [node] = list(cluster.nodes_manager.startup_nodes.values())
    conn = node.acquire_connection()
    opening, go, writers = asyncio.Event(), asyncio.Event(), []
    real_open = asyncio.open_connection

    async def open_when_told(*args, **kwargs):
        opening.set()
        await go.wait()
        reader, writer = await real_open(*args, **kwargs)
        writers.append(writer)
        return reader, writer

    monkeypatch.setattr(asyncio, "open_connection", open_when_told)
    opened = asyncio.create_task(conn.connect())
    await opening.wait()
    if closed == "while opening":
        await node.disconnect()  # what the rediscovery does to every node it replaces
    go.set()
    if closed == "never":
        await opened
        assert conn.is_connected and not writers[0].is_closing()
        await node.disconnect()
    else:
        with pytest.raises(RedisConnectionError, match="closed while it was being opened"):
            await opened
    assert not conn.is_connected and writers[0].is_closing()
