"""``python -m api``: the web process (uvicorn on LLMQ_HOST:LLMQ_PORT), or LLMQ_WEB_PROCESSES of them.

One web process relays on one core. With ``LLMQ_WEB_PROCESSES=N`` (N > 1) this process becomes a
small supervisor: it binds N listening sockets to the one port with ``SO_REUSEPORT`` and runs
``python -m api --socket-fd FD --parent PID`` once per socket. Each child is a whole web process of
its own (fresh interpreter: its own app, Redis client, listener, home channel and counters, built
by its own lifespan), and the kernel spreads new connections over the N sockets.

Why ``SO_REUSEPORT`` and not uvicorn's ``workers=N`` (one socket shared by every child): measured
here, 64 connections opened at once against two idle children, 13 tries each, the shared socket
split them as unevenly as 64/0, 59/5 and 58/6 (12 or fewer on one side in 6 of 13), because the
first child to wake accepts every connection already queued (libuv accepts until EAGAIN);
``SO_REUSEPORT`` hashes each connection to a socket and split them between 40/24 and 32/32.
Streams are long and the relay is CPU-bound, so a child that took 58 of 64 streams would leave
N=2 hardly faster than N=1. The parent keeps every socket open for
the children's whole life, so a child that dies is replaced on the same socket, and connections
the kernel queued on it meanwhile wait for the replacement instead of being reset.

Shutdown is unchanged per process: on SIGTERM (or SIGINT) the parent passes SIGTERM to every child,
each drains its streams as a single web process does (uvicorn's graceful shutdown, at most
``GRACEFUL_S``), and the parent exits once all have. A process manager that signals the whole
process group (honcho) reaches the children directly too: a second SIGTERM changes nothing in
uvicorn. A child that exits by itself is restarted after a second, unless it never started
serving (uvicorn's exit code 3): then the others are stopped and the parent exits 3, as one web
process would. Children get SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), even by SIGKILL,
so none is left holding the port.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import structlog
import uvicorn

from api.auth import refuse_open_bind
from shared.config import Settings, load_tracing, settings_or_exit
from shared.logging import configure_logging

log = structlog.get_logger()

GRACEFUL_S = 10  # uvicorn's timeout_graceful_shutdown: how long a stopping web process lets streams run
STARTUP_FAILURE = 3  # uvicorn's exit code for a server that never started serving (restarting won't help)
RESTART_DELAY_S = 1.0  # between a child's exit and its replacement: no hot loop when one keeps dying
BACKLOG = 2048  # uvicorn's default listen backlog, per socket
_PR_SET_PDEATHSIG = 1


def _uvicorn_options(settings: Settings) -> dict[str, Any]:
    return dict(
        host=settings.host,
        port=settings.port,
        log_config=None,  # uvicorn's loggers go through our structlog set-up
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_S,
        # Longer than the load balancer's idle timeout, so the balancer closes an idle connection
        # first and never reuses one llmq is closing (a spurious 502). uvicorn's default is 5 s.
        timeout_keep_alive=settings.http_keepalive_s,
        # The client is the socket's peer. uvicorn would otherwise take X-Forwarded-For from a
        # loopback peer as the client, so a same-host proxy (or a client naming 127.0.0.1 in the
        # header) would pass for a loopback caller (api/auth.py loopback).
        proxy_headers=False,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m api", description="the llmq web process")
    # Set only by the supervisor below, for each of its children.
    parser.add_argument("--socket-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = settings_or_exit(STARTUP_FAILURE)
    configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    refuse_open_bind(settings)
    if args.socket_fd is not None:
        sys.exit(serve_child(settings, args.socket_fd, args.parent))
    if settings.web_processes < 1:
        log.error("invalid_settings", error=f"LLMQ_WEB_PROCESSES={settings.web_processes} (at least 1)")
        sys.exit(STARTUP_FAILURE)
    if settings.web_processes == 1:
        from api.app import create_app

        uvicorn.run(create_app(settings, load_tracing("llmq-api", "api")), **_uvicorn_options(settings))
        return
    sys.exit(Supervisor(settings).run())


# --- a child: one web process serving a socket its parent bound ------------------------------

def serve_child(settings: Settings, fd: int, parent: int | None) -> int:
    from api.app import create_app  # here, not at the top: the supervisor never loads the app

    _die_with_parent(parent)
    sock = socket.socket(fileno=fd)  # family and type read from the descriptor (AF_INET or AF_INET6)
    # Each web process its own tracer: the batch processor's thread does not survive a fork.
    app = create_app(settings, load_tracing("llmq-api", "api"))
    server = uvicorn.Server(uvicorn.Config(app, **_uvicorn_options(settings)))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained for; the drain is done
        pass
    return 0 if server.started else STARTUP_FAILURE


def _die_with_parent(parent: int | None) -> None:
    """SIGTERM (a graceful drain) when the supervisor dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not permitted in some sandboxes: a SIGKILLed supervisor then leaves its children
    if parent is not None and os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


# --- the supervisor ---------------------------------------------------------------------------

def bind_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets on (host, port), joined by SO_REUSEPORT.

    A plain bind first, without SO_REUSEPORT: it fails if anything already holds the port, so a
    second llmq started on the same port is refused ("address in use") as a single web process
    is, instead of silently sharing its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        if port == 0:
            port = probe.getsockname()[1]
    socks = []
    for _ in range(n):
        sock = socket.socket(family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        # Listening from now on: connections hashed to a socket whose child is still starting (or
        # being replaced) wait in its backlog. Only listening sockets join the reuseport group.
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks


class Supervisor:
    """N children on N SO_REUSEPORT sockets; SIGTERM/SIGINT stop them, each draining as usual."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stopping = False
        self.children: list[subprocess.Popen | None] = []

    def _spawn(self, sock: socket.socket) -> subprocess.Popen:
        fd = sock.fileno()
        return subprocess.Popen([sys.executable, "-m", "api", "--socket-fd", str(fd), "--parent", str(os.getpid())],
                                pass_fds=[fd])

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self._signal_children()

    def _signal_children(self) -> None:
        for child in self.children:
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        n = self.settings.web_processes
        try:
            socks = bind_sockets(self.settings.host, self.settings.port, n)
        except OSError as exc:
            log.error("web_bind_failed", host=self.settings.host, port=self.settings.port, error=str(exc))
            return STARTUP_FAILURE
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        self.children = [self._spawn(sock) for sock in socks]
        if self.stopping:  # the signal came while they were being started
            self._signal_children()
        log.info("web_processes_started", processes=n, pids=[c.pid for c in self.children if c is not None],
                 host=self.settings.host, port=socks[0].getsockname()[1])
        code = 0
        restart_at: dict[int, float] = {}
        while True:
            for i, child in enumerate(self.children):
                if child is None:
                    if not self.stopping and time.monotonic() >= restart_at[i]:
                        child = self.children[i] = self._spawn(socks[i])
                        log.info("web_process_restarted", slot=i, pid=child.pid)
                        if self.stopping:  # the signal came while it was being started
                            self._signal_children()
                    continue
                status = child.poll()
                if status is None or self.stopping:
                    continue
                if status == STARTUP_FAILURE:  # would fail again: stop like one web process would
                    log.error("web_process_failed_to_start", slot=i, pid=child.pid)
                    code = STARTUP_FAILURE
                    self._stop(signal.SIGTERM, None)
                    continue
                log.warning("web_process_exited", slot=i, pid=child.pid, exit_code=status,
                            restart_in_s=RESTART_DELAY_S)
                self.children[i] = None
                restart_at[i] = time.monotonic() + RESTART_DELAY_S
            if self.stopping and all(c is None or c.poll() is not None for c in self.children):
                break
            time.sleep(0.1)
        for sock in socks:
            sock.close()
        log.info("web_processes_stopped", exit_codes=[c.returncode for c in self.children if c is not None])
        return code


if __name__ == "__main__":
    main()
