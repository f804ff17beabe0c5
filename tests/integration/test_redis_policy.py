"""Start-up refuses a Redis that may evict jobs (shared/redis_memory.py ``check_policy``): against
real servers with each policy, a replica on another policy than its primary, a server whose CONFIG
command is renamed away, and a Cluster with one node evicting; then the real processes, the
worker (``python -m workers``) and the web process (``python -m api``), which exit non-zero naming
the node and its policy unless LLMQ_REDIS_ALLOW_EVICTION=true."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis import Redis as SyncRedis

from shared.redis import connect
from shared.redis_memory import EvictingRedis, check_policy, node_policies
from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.redis_cluster import start_cluster
from tests.support.redis_sentinel import start_sentinel
from tests.support.redis_servers import BINARIES, servers

NOEVICTION = ("--maxmemory-policy", "noeviction")


async def _serving(proc: subprocess.Popen, port: int, log: Path) -> None:
    """Until the web process on ``port`` answers /livez (it must not exit meanwhile)."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if (await client.get("/livez")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.1)


async def _check(url: str, *, allow: bool = False) -> dict[str, str]:
    redis = connect(url)
    try:
        return await check_policy(redis, allow_eviction=allow, process="test")
    finally:
        await redis.aclose()


@pytest.mark.parametrize("binary", BINARIES)
@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "allkeys-random", "volatile-ttl"])
async def test_an_evicting_server_is_refused_naming_its_policy(tmp_path, binary, policy):
    with servers(tmp_path) as s:
        server = s.start(binary, "--maxmemory-policy", policy)
        with pytest.raises(EvictingRedis) as refused:
            await _check(server.url)
        assert f"{server.node} has maxmemory-policy {policy}" in str(refused.value)
        assert "LLMQ_REDIS_ALLOW_EVICTION" in str(refused.value)
        # The override lets it start; the policies read are returned either way.
        assert await _check(server.url, allow=True) == {server.node: policy}


@pytest.mark.parametrize("binary", BINARIES)
async def test_noeviction_passes(tmp_path, binary):
    with servers(tmp_path) as s:
        server = s.start(binary, *NOEVICTION)
        assert await _check(server.url) == {server.node: "noeviction"}


async def test_the_default_policy_of_a_bare_server_is_noeviction(tmp_path):
    with servers(tmp_path) as s:
        server = s.start("redis-6.2")
        assert await _check(server.url) == {server.node: "noeviction"}


@pytest.mark.parametrize("binary", BINARIES)
async def test_a_replica_on_another_policy_is_named(tmp_path, binary):
    with servers(tmp_path) as s:
        primary = s.start(binary, *NOEVICTION)
        good = s.start(binary, *NOEVICTION, replica_of=primary)
        bad = s.start(binary, "--maxmemory-policy", "allkeys-lru", replica_of=primary)
        redis = connect(primary.url)
        try:
            assert await node_policies(redis) == {primary.node: "noeviction", good.node: "noeviction",
                                                  bad.node: "allkeys-lru"}
        finally:
            await redis.aclose()
        with pytest.raises(EvictingRedis) as refused:
            await _check(primary.url)
        message = str(refused.value)
        assert f"{bad.node} has maxmemory-policy allkeys-lru" in message
        assert primary.node not in message and good.node not in message


async def test_a_sentinel_replica_on_another_policy_is_named(tmp_path):
    topology = start_sentinel(tmp_path / "sentinel")
    try:
        primary = topology.primary_port()
        replica = next(port for port in topology.node_ports if port != primary)
        with SyncRedis(port=replica) as client:
            client.config_set("maxmemory-policy", "allkeys-lru")
        redis = connect(topology.url)
        try:
            policies = await node_policies(redis)
        finally:
            await redis.aclose()
        assert policies == {f"127.0.0.1:{port}": "allkeys-lru" if port == replica else "noeviction"
                            for port in topology.node_ports}
        with pytest.raises(EvictingRedis, match=f"127.0.0.1:{replica} has maxmemory-policy allkeys-lru"):
            await _check(topology.url)
    finally:
        topology.stop()


async def test_a_server_without_config_is_still_checked_through_info(tmp_path):
    with servers(tmp_path) as s:
        bad = s.start("redis-6.2", "--maxmemory-policy", "volatile-lru", "--rename-command", "CONFIG", "")
        good = s.start("redis-6.2", *NOEVICTION, "--rename-command", "CONFIG", "")
        with bad.client() as client:
            with pytest.raises(Exception, match="unknown command"):
                client.config_get("maxmemory-policy")
        with pytest.raises(EvictingRedis, match=f"{bad.node} has maxmemory-policy volatile-lru"):
            await _check(bad.url)
        assert await _check(good.url) == {good.node: "noeviction"}


async def test_a_cluster_with_one_evicting_node_is_refused(tmp_path):
    cluster = start_cluster(tmp_path, masters=3)
    try:
        url = cluster.url
        assert set((await _check(url)).values()) == {"noeviction"}
        evicting = f"127.0.0.1:{cluster.ports[1]}"
        with SyncRedis.from_url(cluster.node_url(1)) as node:
            node.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(EvictingRedis) as refused:
            await _check(url)
        message = str(refused.value)
        assert f"{evicting} has maxmemory-policy allkeys-lru" in message
        for port in (cluster.ports[0], cluster.ports[2]):
            assert f"127.0.0.1:{port}" not in message
        policies = await _check(url, allow=True)
        assert len(policies) == 3 and policies[evicting] == "allkeys-lru"
    finally:
        cluster.stop()


# --- the processes ------------------------------------------------------------------------------

def _env(url: str, tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    return {**env, "LLMQ_REDIS_URL": url, "LLMQ_DEVICE_LOCK_DIR": str(tmp_path / "locks"), "LLMQ_LOG_JSON": "true",
            **extra}


def _json_lines(out: str) -> list[dict]:
    lines = []
    for line in out.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return [line for line in lines if isinstance(line, dict)]


def _run(module: str, env: dict[str, str], log, timeout_s: float = 30) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = spawn_logged([sys.executable, "-m", module], log, env=env, cwd=REPO)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"python -m {module} still running after {timeout_s} s:\n{log.read_text()}") from None
    return code, log.read_text(), time.monotonic() - start


async def test_the_worker_exits_before_loading_an_engine(tmp_path):
    with servers(tmp_path) as s:
        server = s.start("redis-6.2", "--maxmemory-policy", "allkeys-lru")
        code, out, took = _run("workers", _env(server.url, tmp_path), tmp_path / "worker.log")
        assert code == 1, out
        [error] = [line for line in _json_lines(out) if line.get("event") == "redis_may_evict_jobs"]
        assert error["level"] == "error" and error["process"] == "worker", error
        assert error["nodes"] == f"{server.node} has maxmemory-policy allkeys-lru", error
        assert "engine_loading" not in out and "vllm" not in out.lower(), out
        assert took < 20, took


async def test_the_web_process_exits_naming_the_node_unless_allowed(tmp_path):
    with servers(tmp_path) as s:
        primary = s.start("redis-6.2", *NOEVICTION)
        replica = s.start("redis-6.2", "--maxmemory-policy", "allkeys-lru", replica_of=primary)
        port = free_port()
        code, out, _ = _run("api", _env(primary.url, tmp_path, LLMQ_PORT=str(port)), tmp_path / "api.log")
        assert code != 0, out
        assert f"{replica.node} has maxmemory-policy allkeys-lru" in out, out
        assert "Application startup failed" in out

        # Allowed: it starts, answers, and says what it allowed.
        log = tmp_path / "api-allowed.log"
        proc = spawn_logged([sys.executable, "-m", "api"], log, cwd=REPO,
                            env=_env(primary.url, tmp_path, LLMQ_PORT=str(port), LLMQ_REDIS_ALLOW_EVICTION="true"))
        try:
            await _serving(proc, port, log)
            [warning] = [line for line in _json_lines(log.read_text()) if line.get("event") == "redis_may_evict_jobs"]
            assert warning["level"] == "warning" and warning["allowed_by"] == "LLMQ_REDIS_ALLOW_EVICTION"
            assert warning["nodes"] == f"{replica.node} has maxmemory-policy allkeys-lru", warning
        finally:
            proc.terminate()
            # uvicorn re-raises the SIGTERM it drained for.
            assert proc.wait(20) in (0, -15), log.read_text()
        assert "Application shutdown complete" in log.read_text()


async def test_the_web_process_started_before_redis_stops_once_redis_answers_evicting(tmp_path):
    """Started while Redis is down it serves (503s), then checks once Redis answers and stops."""
    redis_port, port = free_port(), free_port()
    log = tmp_path / "api-early.log"
    proc = spawn_logged([sys.executable, "-m", "api"], log, cwd=REPO,
                        env=_env(f"redis://127.0.0.1:{redis_port}/0", tmp_path, LLMQ_PORT=str(port)))
    try:
        with servers(tmp_path) as s:
            await _serving(proc, port, log)
            s.start_on(redis_port, "redis-6.2", "--maxmemory-policy", "allkeys-lru")
            code = await asyncio.to_thread(proc.wait, 30)
        assert code != 0, log.read_text()
        [error] = [line for line in _json_lines(log.read_text()) if line.get("event") == "redis_may_evict_jobs"]
        assert error["level"] == "error" and error["process"] == "web"
        assert error["nodes"] == f"127.0.0.1:{redis_port} has maxmemory-policy allkeys-lru"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
