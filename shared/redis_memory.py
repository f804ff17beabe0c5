"""Redis's memory as a limit llmq stays under: the start-up check of every node's eviction policy,
and the watermark that stops admissions before Redis refuses the running jobs' writes.

An evicting policy deletes job records and streams silently under pressure, so the web process and
the worker refuse to start unless every node they reach reports ``maxmemory_policy:noeviction``
(INFO, since CONFIG may be renamed; LLMQ_REDIS_ALLOW_EVICTION overrides). With noeviction a full
Redis refuses writes, the tokens of running jobs included, so admissions stop earlier: at
LLMQ_REDIS_MEMORY_WATERMARK of ``maxmemory``, sampled at most every half second per node.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool

from shared.redis import REDIS_DOWN

__all__ = ["EvictingRedis", "MemoryGuard", "check_policy", "node_policies"]

SAMPLE_EVERY_S = 0.5
UNREACHABLE = "unreachable"


class EvictingRedis(RuntimeError):
    """A Redis node llmq reaches may evict keys: it would delete jobs under memory pressure."""


def _ratio(info: dict[str, Any]) -> float:
    # What Redis weighs against maxmemory: replication and AOF buffers are not counted (INFO memory
    # says how much; Valkey and Redis 6.2 both report mem_not_counted_for_evict).
    limit = int(info.get("maxmemory", 0))
    if limit <= 0:
        return 0.0
    return (int(info.get("used_memory", 0)) - int(info.get("mem_not_counted_for_evict", 0))) / limit


class MemoryGuard:
    """Whether a node's memory leaves room for a new job, from INFO memory at most every
    :data:`SAMPLE_EVERY_S` per node (a sample is shared by the admissions that wait for it)."""

    def __init__(self, redis: Redis, watermark: float) -> None:
        self.redis, self.watermark = redis, watermark
        self._samples: dict[str, tuple[float, float]] = {}  # node -> (when, used share of maxmemory)
        self._sampling: dict[str, asyncio.Task[float]] = {}

    async def used(self, key: str) -> float:
        """The used share of ``maxmemory`` (0 with no limit) on the node that holds ``key``."""
        node = None
        name = "primary"
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()
            node = self.redis.get_node_from_key(key)
            name = node.name
        when, share = self._samples.get(name, (-SAMPLE_EVERY_S, 0.0))
        if time.monotonic() - when < SAMPLE_EVERY_S:
            return share
        task = self._sampling.get(name)
        if task is None:
            task = self._sampling[name] = asyncio.ensure_future(self._sample(name, node))
            task.add_done_callback(lambda _: self._sampling.pop(name, None))
        return await asyncio.shield(task)

    async def admits(self, key: str) -> bool:
        return self.watermark >= 1 or await self.used(key) < self.watermark

    async def _sample(self, name: str, node: Any) -> float:
        kwargs = {"target_nodes": node} if node is not None else {}
        share = _ratio(await self.redis.info("memory", **kwargs))
        self._samples[name] = (time.monotonic(), share)
        return share


async def node_policies(redis: Redis) -> dict[str, str]:
    """``host:port`` -> ``maxmemory_policy`` of every node ``redis`` reaches: each primary and
    replica of a Cluster, the Sentinel primary and the replicas Sentinel knows, or one server and
    the replicas its INFO replication lists."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        return {node.name: str((await redis.info("memory", target_nodes=node))["maxmemory_policy"])
                for node in redis.get_nodes()}
    pool = redis.connection_pool
    primary = await redis.info("memory")
    if isinstance(pool, SentinelConnectionPool):
        host, port = await pool.get_master_address()
        replicas = [tuple(r) for r in await pool.sentinel_manager.discover_slaves(pool.service_name)]
    else:
        host, port = pool.connection_kwargs.get("host", "localhost"), pool.connection_kwargs.get("port", 6379)
        replication = await redis.info("replication")
        replicas = [(v["ip"], int(v["port"])) for k, v in replication.items()
                    if k.startswith("slave") and isinstance(v, dict)]
    policies = {f"{host}:{port}": str(primary["maxmemory_policy"])}
    for replica_host, replica_port in replicas:
        client = _replica_client(pool, str(replica_host), int(replica_port))
        try:
            policy = str((await client.info("memory"))["maxmemory_policy"])
        except REDIS_DOWN:  # an address only its primary can reach (NAT, another network)
            policy = UNREACHABLE
        finally:
            await client.aclose()
        policies[f"{replica_host}:{replica_port}"] = policy
    return policies


def _replica_client(pool: ConnectionPool, host: str, port: int) -> Redis:
    # The primary's credentials and TLS options, another address; a Sentinel pool's connection
    # class resolves the primary itself, so a replica gets the plain class of the same transport.
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    tls = issubclass(pool.connection_class, SSLConnection)
    return Redis.from_pool(ConnectionPool(connection_class=SSLConnection if tls else Connection,
                                          **{**kwargs, "host": host, "port": port}))


async def check_policy(redis: Redis, *, allow_eviction: bool, process: str) -> dict[str, str]:
    """Raise :class:`EvictingRedis`, naming each node and its policy, unless every node reports
    ``noeviction`` or ``allow_eviction`` (then it is logged); returns the policies read."""
    log = structlog.get_logger()
    policies = await node_policies(redis)
    if unreachable := sorted(node for node, policy in policies.items() if policy == UNREACHABLE):
        log.warning("redis_replica_unchecked", process=process, nodes=unreachable)
    evicting = {node: policy for node, policy in policies.items() if policy not in ("noeviction", UNREACHABLE)}
    if not evicting:
        return policies
    named = ", ".join(f"{node} has maxmemory-policy {policy}" for node, policy in sorted(evicting.items()))
    if allow_eviction:
        log.warning("redis_may_evict_jobs", process=process, nodes=named, allowed_by="LLMQ_REDIS_ALLOW_EVICTION")
        return policies
    log.error("redis_may_evict_jobs", process=process, nodes=named)
    raise EvictingRedis(f"Redis may evict llmq's jobs: {named}. Set maxmemory-policy noeviction on every node "
                        "(docs/operations.md#redis), or LLMQ_REDIS_ALLOW_EVICTION=true to start anyway")
