"""What differs on a Redis Cluster (``connect()`` given ``redis+cluster://``): pub/sub.

Keys need nothing here: every multi-key command and script names one model's keys, which share
the ``{model}`` hash tag, so redis-py routes them to the slot's node. Pub/sub is another matter:

- Plain PUBLISH reaches every node (the cluster bus broadcasts it), so a subscriber may sit on
  any node. redis-py's async RedisCluster has no ``pubsub()`` and no ``publish()``: subscribers
  get a raw connection to one node (:func:`pubsub_connection`, :func:`node_client`) and
  publishers send PUBLISH through ``execute_command`` (:func:`publish`), routed by the channel.
- Sharded pub/sub (Redis >= 7: SPUBLISH / SSUBSCRIBE) keeps a message on the shard owning the
  channel's slot instead of broadcasting it to every node. llmq uses it for the per-job live
  channels when every master runs Redis >= 7 (:func:`sharded_pubsub`); the live channel carries
  the model's hash tag, so a script may SPUBLISH it from the model's slot.
"""

from __future__ import annotations

import random

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, ConnectionPool

__all__ = ["is_cluster", "sharded_pubsub", "publish", "pubsub_connection", "node_client", "SHARDED_FROM"]

# The first Redis version with sharded pub/sub.
SHARDED_FROM = (7, 0, 0)


def is_cluster(redis: Redis) -> bool:
    return isinstance(redis, RedisCluster)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


async def sharded_pubsub(redis: Redis) -> bool:
    """True when live events should use SPUBLISH/SSUBSCRIBE: a Cluster whose every master runs
    Redis >= 7 (INFO server, ``redis_version``). A standalone server always uses plain pub/sub
    (sharding buys nothing on one node), and so does a Cluster with any older master."""
    if not isinstance(redis, RedisCluster):
        return False
    await redis.initialize()
    for node in redis.get_primaries():
        info = await redis.info("server", target_nodes=node)
        if _version(str(info.get("redis_version", "0"))) < SHARDED_FROM:
            return False
    return True


async def publish(redis: Redis, channel: str, message: bytes | str, *, sharded: bool = False) -> int:
    """PUBLISH (or SPUBLISH) on either client; on a Cluster routed by the channel's slot."""
    return await redis.execute_command("SPUBLISH" if sharded else "PUBLISH", channel, message)


def _cluster_node(redis: RedisCluster, node: ClusterNode | None) -> ClusterNode:
    # Any master will do for plain pub/sub; a random one spreads API processes over the nodes
    # and lets a reconnect after a node failure try another one.
    return node or random.choice(redis.get_primaries())


async def pubsub_connection(redis: Redis, node: ClusterNode | None = None) -> AbstractConnection:
    """A new raw connection opened like the client's own (URL, auth, TLS, handshake), for a
    subscriber that reads it with no per-read timeout. On a Cluster: to ``node``, or to a random
    master. Not connected yet: the caller connects and owns it."""
    overrides = {"socket_timeout": None, "decode_responses": False}
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        target = _cluster_node(redis, node)
        return target.connection_class(**{**target.connection_kwargs, **overrides})
    pool = redis.connection_pool
    return pool.connection_class(**{**pool.connection_kwargs, **overrides})


async def node_client(redis: Redis) -> Redis:
    """A client whose ``pubsub()`` works: ``redis`` itself, or on a Cluster a standalone client of
    one random master (the caller closes it: ``aclose()``)."""
    if not isinstance(redis, RedisCluster):
        return redis
    await redis.initialize()
    target = _cluster_node(redis, None)
    pool = ConnectionPool(connection_class=target.connection_class, **target.connection_kwargs)
    return Redis.from_pool(pool)  # closing the client closes its pool
