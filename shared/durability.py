"""What an acknowledgement means (LLMQ_DURABILITY), and the one place that makes it so.

Redis replicates asynchronously: a primary that dies before its replicas received a job takes the
job with it, and a failover promotes a replica that never had it. Under ``replicas:N`` the enqueue
script and ``WAIT N <timeout>`` go out together in one pipeline, on the connection that wrote: WAIT
counts only its own connection's writes, so redis-py's ``RedisCluster.wait()``, which sends it to
another node on another connection, would count nothing (a pilot lost 4,718 acknowledged jobs with
it). Never inside MULTI or a script either: WAIT does not block there. The caller answers only once
N replicas hold the job; fewer is a 503 (shared/errors.py NotDurable), the job possibly still run,
so clients retry with the same Idempotency-Key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import PipelineCommand
from redis.exceptions import AskError, ClusterDownError, NoScriptError, SlotNotCoveredError, TryAgainError

__all__ = ["Durability", "NOT_DURABLE", "check_server", "replicas_of", "run_and_wait"]

_MODE = re.compile(r"replicas:([1-9][0-9]*)")


def replicas_of(mode: str) -> int:
    """The replicas an admission waits for under LLMQ_DURABILITY ``mode``: 0 for ``none`` and
    ``fsync``. Raises ValueError for anything else."""
    mode = mode.strip().lower()
    if mode in ("none", "fsync"):
        return 0
    if match := _MODE.fullmatch(mode):
        return int(match[1])
    raise ValueError(f"LLMQ_DURABILITY={mode!r} (none, fsync, or replicas:N with N >= 1)")


class Durability(NamedTuple):
    """What must hold a job before it is acknowledged, and how long to wait for it: ``replicas``
    replicas (WAIT), or with ``fsync`` the primary's own AOF on disk (WAITAOF 1 0, Redis 7.2+ and
    Valkey); neither: the primary's memory."""

    replicas: int = 0
    timeout_ms: int = 1000
    fsync: bool = False

    @classmethod
    def of(cls, mode: str, timeout_ms: int) -> Durability:
        return cls(replicas_of(mode), timeout_ms, mode.strip().lower() == "fsync")

    @property
    def wanted(self) -> int:
        """The confirmations an acknowledgement needs (0: none is waited for)."""
        return 1 if self.fsync else self.replicas

    def command(self) -> tuple[Any, ...]:
        """The command that waits, sent right after the write on the same connection."""
        if self.fsync:
            return ("WAITAOF", 1, 0, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)


WAITAOF_FROM = (7, 2)
"""The first Redis version with WAITAOF."""

NOT_DURABLE = Durability()
"""LLMQ_DURABILITY=none: acknowledged once the primary holds the job."""

# A slot that moved or is unserved: a failover is under way. The cluster client re-reads the slots at
# its next command; this admission is refused (503) and retried by its client.
_SLOT_MOVED = (AskError, ClusterDownError, SlotNotCoveredError, TryAgainError)


async def run_and_wait(redis: Redis, sha: str, text: str, keys: Sequence[str], args: Sequence[Any],
                       durability: Durability) -> tuple[Any, int]:
    """EVALSHA the script, then WAIT (or WAITAOF), pipelined on one connection (on a Cluster, to
    the primary of ``keys``' slot). Returns the script's reply and the confirmations of its writes:
    replicas, or 1 when the primary's AOF has them on disk."""
    commands = (("EVALSHA", sha, len(keys), *keys, *args), durability.command())
    for attempt in (1, 2):
        if isinstance(redis, RedisCluster):
            reply, acked = await _on_slot_primary(redis, keys[0], commands)
        else:
            async with redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                reply, acked = await pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError) and attempt == 1:  # a restarted or new primary: load it once
            await redis.script_load(text)
            continue
        for result in (reply, acked):
            if isinstance(result, Exception):
                raise result
        return reply, int(acked[0] if durability.fsync else acked)  # WAITAOF: [local, replicas]
    raise AssertionError("unreachable")


async def _on_slot_primary(cluster: RedisCluster, key: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    await cluster.initialize()
    node = cluster.get_node_from_key(key)
    assert node is not None  # None only when a replica is asked for; a slot no node serves raises
    pipeline = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
    try:
        await node.execute_pipeline(pipeline)
    except Exception:
        await cluster.aclose()  # as redis-py does on a failed node: the next command re-reads the slots
        raise
    results = [command.result for command in pipeline]
    if any(isinstance(result, _SLOT_MOVED) for result in results):
        await cluster.aclose()
        raise ClusterDownError(f"the slot of {key} moved (a failover): {results[0]}")
    return results


async def check_server(redis: Redis, durability: Durability) -> None:
    """Raise ValueError at start-up when the primaries cannot give what ``durability`` asks:
    ``fsync`` needs WAITAOF (Redis 7.2+, Valkey) and the AOF on."""
    if not durability.fsync:
        return
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        nodes = redis.get_primaries()
    else:
        nodes = [None]
    for node in nodes:
        target = {"target_nodes": node} if node is not None else {}
        name = node.name if node is not None else "the primary"
        version = str((await redis.info("server", **target)).get("redis_version", "0"))  # Valkey says 7.2.4
        if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < WAITAOF_FROM:
            raise ValueError(f"LLMQ_DURABILITY=fsync needs WAITAOF (Redis 7.2+ or Valkey): {name} runs {version}")
        if str((await redis.info("persistence", **target)).get("aof_enabled")) != "1":
            raise ValueError(f"LLMQ_DURABILITY=fsync needs the AOF on (appendonly yes): {name} has it off")
