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

__all__ = ["Durability", "NOT_DURABLE", "replicas_of", "run_and_wait"]

_MODE = re.compile(r"replicas:([1-9][0-9]*)")


def replicas_of(mode: str) -> int:
    """The replicas an admission waits for under LLMQ_DURABILITY ``mode``: 0 for ``none``.
    Raises ValueError for anything else."""
    mode = mode.strip().lower()
    if mode == "none":
        return 0
    if match := _MODE.fullmatch(mode):
        return int(match[1])
    raise ValueError(f"LLMQ_DURABILITY={mode!r} (none, or replicas:N with N >= 1)")


class Durability(NamedTuple):
    """The replicas that must hold a job before it is acknowledged (0: none), and how long to wait."""

    replicas: int = 0
    timeout_ms: int = 1000

    @classmethod
    def of(cls, mode: str, timeout_ms: int) -> Durability:
        return cls(replicas_of(mode), timeout_ms)


NOT_DURABLE = Durability()
"""LLMQ_DURABILITY=none: acknowledged once the primary holds the job."""

# A slot that moved or is unserved: a failover is under way. The cluster client re-reads the slots at
# its next command; this admission is refused (503) and retried by its client.
_SLOT_MOVED = (AskError, ClusterDownError, SlotNotCoveredError, TryAgainError)


async def run_and_wait(redis: Redis, sha: str, text: str, keys: Sequence[str], args: Sequence[Any],
                       durability: Durability) -> tuple[Any, int]:
    """EVALSHA the script, then WAIT, pipelined on one connection (on a Cluster, to the primary of
    ``keys``' slot). Returns the script's reply and the replicas that acknowledged its writes."""
    commands = (("EVALSHA", sha, len(keys), *keys, *args), ("WAIT", durability.replicas, durability.timeout_ms))
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
        return reply, int(acked)
    raise AssertionError("unreachable")


async def _on_slot_primary(cluster: RedisCluster, key: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    await cluster.initialize()
    node = cluster.get_node_from_key(key)
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
