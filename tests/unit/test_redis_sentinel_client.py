"""Pointing llmq at Redis Sentinel: the URL spelling, the client it builds, the arq settings it maps
to, and an unreachable Sentinel counted as an outage. No server needed: building a client opens no
connection, and a closed loopback port refuses at once."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import MasterNotFoundError, SentinelConnectionPool, SentinelManagedSSLConnection

from shared.cluster import pubsub_connection
from shared.redis import _handshake, _Retry, connect, sentinel_target, wait_for_redis
from tests.conftest import free_port
from workers.housekeeping.arq_settings import arq_redis_settings


@pytest.mark.parametrize(("url", "sentinels", "service"), [
    ("redis+sentinel://h1:26379,h2:26380,h3/mymaster", (("h1", 26379), ("h2", 26380), ("h3", 26379)), "mymaster"),
    ("redis+sentinel://10.0.0.5/svc/", (("10.0.0.5", 26379),), "svc"),
    ("REDIS+SENTINEL://h1, h2:1/svc/2", (("h1", 26379), ("h2", 1)), "svc"),
    ("redis+sentinel://[::1]:26390,[fe80::2]/svc", (("::1", 26390), ("fe80::2", 26379)), "svc"),
])
def test_a_sentinel_url_names_its_sentinels_and_service(url, sentinels, service):
    target = sentinel_target(url)
    assert target is not None
    assert (target.sentinels, target.service) == (sentinels, service)


@pytest.mark.parametrize(("url", "db"), [
    ("redis+sentinel://h/mymaster", 0),
    ("redis+sentinel://h/mymaster/3", 3),
    ("redis+sentinel://h/mymaster/3?db=5", 5),  # redis-py's reading: the query wins
])
def test_a_sentinel_url_selects_a_db(url, db):
    assert sentinel_target(url).node_options["db"] == db


def test_the_urls_credentials_are_the_data_nodes_and_the_query_names_the_sentinels():
    target = sentinel_target("redis+sentinel://app:p%40ss@h1,h2/mymaster"
                             "?sentinel_username=watcher&sentinel_password=s%26cret&health_check_interval=7")
    assert (target.node_options["username"], target.node_options["password"]) == ("app", "p@ss")
    assert target.node_options["health_check_interval"] == 7
    assert target.node_options["ssl"] is False
    assert target.sentinel_options == {"username": "watcher", "password": "s&cret"}
    assert not any(key.startswith("sentinel_") for key in target.node_options)


def test_without_sentinel_credentials_the_sentinels_get_none():
    target = sentinel_target("redis+sentinel://:pw@h/mymaster")
    assert target.sentinel_options == {} and target.node_options["password"] == "pw"
    assert "username" not in target.node_options


def test_the_targets_repr_shows_no_credentials():
    shown = repr(sentinel_target("redis+sentinel://app:PLANTEDpw@h/mymaster?sentinel_password=PLANTEDsp"))
    assert "PLANTED" not in shown and "mymaster" in shown


def test_a_tls_sentinel_url_uses_tls_to_the_data_nodes_with_its_query_options():
    target = sentinel_target("rediss+sentinel://h/mymaster?ssl_ca_certs=/ca.pem&ssl_check_hostname=true")
    assert target.node_options["ssl"] is True
    assert (target.node_options["ssl_ca_certs"], target.node_options["ssl_check_hostname"]) == ("/ca.pem", True)


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://h/0", "redis+cluster://h:7000", "unix:///tmp/r.sock",
                                 "sentinel://h:26379"])
def test_other_urls_are_no_sentinel_urls(url):
    assert sentinel_target(url) is None


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h1,h2", "names no service"),
    ("redis+sentinel://h1,h2/", "names no service"),
    ("redis+sentinel://:PLANTEDpw@/mymaster", "names no Sentinel"),
    ("redis+sentinel://,/mymaster", "names no Sentinel"),
    ("redis+sentinel://h1:port/mymaster", "bad Sentinel address 'h1:port'"),
    ("redis+sentinel://h1:99999/mymaster", "bad Sentinel address"),
    ("redis+sentinel://:26379/mymaster", "bad Sentinel address"),
    ("redis+sentinel://h1/mymaster/x", "db that is no number"),
    ("redis+sentinel://h1/mymaster/0/extra", "path beyond"),
])
def test_a_bad_sentinel_url_is_a_clear_error_at_start_up(url, says):
    with pytest.raises(ValueError, match=says) as error:
        connect(url)
    assert "PLANTED" not in str(error.value) and "redis+sentinel://" in str(error.value)


def test_a_sentinel_url_builds_a_client_with_the_same_timeouts_retry_and_handshake():
    client = connect("rediss+sentinel://app:s3cret@127.0.0.1:26379,127.0.0.2/mymaster/2?sentinel_password=sp",
                     block_ms=3000)
    assert type(client) is Redis
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master and pool.service_name == "mymaster"
    assert pool.connection_class is SentinelManagedSSLConnection
    kwargs = pool.connection_kwargs
    timeouts = (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"])
    assert timeouts == (13.0, 5, 30)
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "s3cret", 2)
    assert isinstance(kwargs["retry"], _Retry) and kwargs["redis_connect_func"] is _handshake
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"], s.get("password")) for s in sentinels] == [
        ("127.0.0.1", 26379, "sp"), ("127.0.0.2", 26379, "sp")]
    assert all(s.get("username") is None for s in sentinels)  # the data nodes' user is not theirs


async def test_a_connection_of_the_client_keeps_its_handshake_retry_and_pool():
    # What the pub/sub listener opens (api/listener.py): built like the client's own, so each
    # reconnect asks the Sentinels for the primary of the moment.
    client = connect("redis+sentinel://127.0.0.1/mymaster")
    conn = await pubsub_connection(client)
    assert conn.redis_connect_func is _handshake and isinstance(conn.retry, _Retry)
    assert conn.connection_pool.service_name == "mymaster" and conn.socket_timeout is None
    await client.aclose()


async def test_no_reachable_sentinel_is_an_outage_that_wait_for_redis_waits_out():
    client = connect(f"redis+sentinel://app:PLANTEDpw@127.0.0.1:{free_port()}/mymaster?sentinel_password=PLANTEDsp")
    with pytest.raises(MasterNotFoundError) as error:
        await client.ping()
    assert "PLANTED" not in str(error.value)  # wait_for_redis logs it
    waiting = asyncio.create_task(wait_for_redis(client, what="test", max_delay_s=0.1))
    await asyncio.sleep(1.0)
    assert not waiting.done()  # still retrying: MasterNotFoundError is a ConnectionError, not a failure
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await client.aclose()


def test_arq_gets_the_sentinels_service_db_and_data_node_credentials():
    settings = arq_redis_settings("redis+sentinel://app:p%40ss@h1:26380,h2/mymaster/4")
    assert settings.sentinel is True and settings.sentinel_master == "mymaster"
    assert settings.host == [("h1", 26380), ("h2", 26379)]
    assert (settings.database, settings.username, settings.password, settings.ssl) == (4, "app", "p@ss", False)
    assert "p@ss" not in repr(settings)


def test_arq_over_tls_sentinel_keeps_tls():
    settings = arq_redis_settings("rediss+sentinel://h1/mymaster")
    assert settings.sentinel is True and settings.ssl is True and settings.database == 0


def test_arq_cannot_authenticate_to_sentinels_and_says_so():
    # arq's Sentinel client passes no credentials to the Sentinels: better a clear error at start-up
    # than housekeeping that never connects.
    with pytest.raises(ValueError, match="LLMQ_ARQ_REDIS_URL") as error:
        arq_redis_settings("redis+sentinel://h1/mymaster?sentinel_password=PLANTEDsp")
    assert "PLANTED" not in str(error.value)
