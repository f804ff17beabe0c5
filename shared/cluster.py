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
- A worker's control channel doubles as its sign of life (workers/runner.py, the watcher): PUBSUB
  NUMSUB counts the subscribers of the node it is sent to, so a worker subscribes on one node
  everyone can name, the master owning its model's slot (:func:`node_client` with a key), and
  peers count there first (:func:`subscribers`).
"""

from __future__ import annotations

import random
from typing import TypeGuard

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, ConnectionPool

__all__ = ["is_cluster", "sharded_pubsub", "publish", "pubsub_connection", "node_client", "subscribers",
           "SHARDED_FROM"]

# The first Redis version with sharded pub/sub.
SHARDED_FROM = (7, 0, 0)


def is_cluster(redis: Redis) -> TypeGuard[RedisCluster]:
    """True when ``connect()`` made a Cluster client; a TypeGuard, so the caller's branch then
    holds a RedisCluster (``connect()`` is annotated as returning a plain Redis)."""
    return isinstance(redis, RedisCluster)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


async def sharded_pubsub(redis: Redis | RedisCluster) -> bool:
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


async def pubsub_connection(redis: Redis | RedisCluster, node: ClusterNode | None = None) -> AbstractConnection:
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


async def node_client(redis: Redis, key: str | None = None) -> Redis:
    """A client whose ``pubsub()`` works: ``redis`` itself, or on a Cluster a standalone client of
    the master serving ``key``'s slot (of a random master without ``key``); the caller closes it
    (``aclose()``)."""
    if not isinstance(redis, RedisCluster):
        return redis
    await redis.initialize()
    target = redis.get_node_from_key(key) if key is not None else _cluster_node(redis, None)
    pool = ConnectionPool(connection_class=target.connection_class, **target.connection_kwargs)
    return Redis.from_pool(pool)  # closing the client closes its pool


async def subscribers(redis: Redis, channels: list[str], key: str) -> list[int]:
    """Each channel's number of (plain) subscribers, in order.

    On a Cluster PUBSUB NUMSUB counts one node's subscribers only. It is asked of the master
    serving ``key``'s slot, where :func:`node_client` with the same key subscribes; a channel with
    none there is asked of every other master too (rare: a suspect), so a subscriber that sits
    elsewhere (a worker from before this rule, or one that subscribed before a slot moved) still
    counts."""
    if not isinstance(redis, RedisCluster):
        return [n for _, n in await redis.pubsub_numsub(*channels)]
    await redis.initialize()
    home = redis.get_node_from_key(key)
    # (RedisCluster has no pubsub_numsub(); its reply callback turns every node's reply into
    # (channel, count) pairs, summed per channel over the nodes asked.)
    counts = [n for _, n in await redis.execute_command("PUBSUB NUMSUB", *channels, target_nodes=home)]
    missing = [c for c, n in zip(channels, counts, strict=True) if n == 0]
    others = [node for node in redis.get_primaries() if node.name != home.name]
    if missing and others:
        elsewhere = dict(await redis.execute_command("PUBSUB NUMSUB", *missing, target_nodes=others))
        counts = [n or elsewhere.get(c.encode(), 0) for c, n in zip(channels, counts, strict=True)]
    return counts
