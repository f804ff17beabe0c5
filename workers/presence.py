"""A worker's presence in Redis: its heartbeat key, its place in the ready set, its control
channel, and the judgement of peers by theirs. One :class:`Presence` per worker, owned by
:class:`workers.runner.Worker`; every Redis command it sends is a
:class:`shared.registry.Registry` method.

The control channel is also the worker's sign of life. Its subscription lives exactly as long as
its process (the kernel closes a dead process's sockets, and Redis drops their subscriptions at
once), so a peer that finds a worker holding jobs with nobody subscribed to its channel for
``LLMQ_TAKEOVER_S`` takes those jobs over without waiting for their leases (workers/runner.py,
the watcher). Hence: no job is read before the subscription is confirmed
(:attr:`Presence.control_up`), a dropped connection is re-subscribed at once, and
:attr:`Presence.watch_from` keeps :meth:`Presence.dead_peers` from judging peers until they all
had time to re-subscribe after an outage that dropped everyone's connection.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import msgspec
import structlog

from shared.metrics import encode_samples
from shared.queue import now_ms
from shared.redis import REDIS_DOWN
from shared.slo import Rates
from shared.status import Parallel

if TYPE_CHECKING:
    from shared.config import Settings
    from shared.metrics import Recorder
    from shared.registry import Registry

__all__ = ["Presence", "RECONNECT_MAX_S", "Status"]

log = structlog.get_logger()

# The longest pause between a lost control connection's attempts to re-subscribe (the first
# comes at once). After an outage of Redis every worker is back within about this long, which
# is what the watcher waits (twice over) before it counts anyone's absence.
RECONNECT_MAX_S = 0.5

Status = Literal["warming", "ready", "draining"]
"""What the heartbeat says of the worker; only a ``ready`` one is in the model's ready set."""


class Presence:
    """The presence of worker ``worker_id`` of ``settings.model_name``. Its host says what to
    advertise at each :meth:`beat` and what a cancel notice does (:meth:`control`)."""

    def __init__(self, settings: Settings, registry: Registry, worker_id: str, metrics: Recorder, *,
                 device: str = "", devices: Sequence[str] = (), rates: Callable[[], Rates] = Rates) -> None:
        self.settings = settings
        self.registry = registry
        self.model = settings.model_name
        self.worker_id = worker_id
        self.metrics = metrics
        """The host's counters and histograms, pushed with each heartbeat (shared/metrics.py)."""
        self.device = device
        """The GPU(s) or CPU share this process claimed (workers/claim.py)."""
        self.devices = msgspec.json.encode(list(devices))
        """Its engine's devices on this host, one per rank here, as JSON (they never change)."""
        self.parallel = msgspec.json.encode(Parallel.of(settings))
        self.rates = rates
        """Its speed as measured so far (workers/rates.py), read at each beat; by default none
        (a heartbeat with no engine behind it, tests/support/heartbeats.py)."""
        self.started_at = now_ms()
        self.control_up = asyncio.Event()
        """Set while the control subscription is confirmed: the worker reads jobs only then."""
        self.watch_from = float("inf")  # until the control subscription is first confirmed
        """Loop time before which :meth:`dead_peers` counts no peer's absence (our own
        subscription came up only recently: after an outage, peers may still be re-subscribing)."""

    # --- our own presence ---------------------------------------------------------------------

    def _heartbeat_fields(self, status: Status, running: int,
                          adapters: Sequence[str]) -> dict[str, str | int | float | bytes]:
        return {
            "model": self.model,
            "slots": self.settings.max_num_seqs,
            # Its engine's context: vLLM takes it as set or refuses to start. The API advertises it.
            "max_model_len": self.settings.max_model_len,
            "running": running,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": self.device,
            "devices": self.devices,
            # Its engine's layout, tensor × pipeline over hosts (docs/operations.md#sizing), as JSON.
            "parallel": self.parallel,
            "started": self.started_at,
            "status": status,
            "last_heartbeat": now_ms(),
            # The LoRA adapters its engine holds (workers/adapters.py), as JSON: read by llmq-status.
            "adapters": msgspec.json.encode(list(adapters)),
            # Its measured prefill and decode rates, as JSON: SLO-aware admission predicts a waiting
            # job's first token from its model's warm workers' (shared/slo.py).
            "rates": msgspec.json.encode(self.rates()),
            # Its Prometheus counters and histograms, served by the API's /metrics.
            "metrics": encode_samples(self.metrics.samples()),
        }

    async def beat(self, status: Status, running: int, adapters: Sequence[str] = ()) -> None:
        """Renew the worker's key (TTL: three heartbeats) and, while ``ready``, its place in the
        ready set, from which the API answers health checks: only warm workers are in it."""
        await self.registry.beat(self.model, self.worker_id, self._heartbeat_fields(status, running, adapters),
                              self.settings.heartbeat_s * 3, advertise=status == "ready")

    async def unregister(self) -> None:
        """Leave nothing behind (a clean stop); with Redis away the key's TTL does it instead."""
        try:
            await self.registry.deregister(self.model, self.worker_id)
        except REDIS_DOWN:
            pass

    def _control_confirmed(self) -> None:
        self.control_up.set()
        self.watch_from = asyncio.get_running_loop().time() + 2 * RECONNECT_MAX_S

    async def control(self, cancel: Callable[[str], bool]) -> None:
        """Abort jobs on request (DELETE /v1/jobs/{id}): ``cancel`` gets the notice's job id and
        says whether the job ran here. The subscription itself says this process is alive (see
        the module docstring). Runs until cancelled."""
        delay = 0.0
        while True:
            try:
                async with self.registry.control_subscription(self.model, self.worker_id) as pubsub:
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is None:
                            continue
                        if message["type"] == "subscribe":
                            # Confirmed: the first time, or after redis-py reconnected and
                            # re-subscribed by itself (a dropped connection, a restarted Redis).
                            self._control_confirmed()
                            delay = 0.0
                        elif message["type"] == "message":
                            cancel(message["data"].decode())  # it logs the jobs it had
            except REDIS_DOWN as exc:
                self.control_up.clear()
                log.warning("control_channel_lost", error=str(exc), retry_in_s=delay)
                # At once the first time: peers take a worker without a subscription for dead
                # after LLMQ_TAKEOVER_S. Then backing off, while Redis itself is away.
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), RECONNECT_MAX_S)

    # --- peers' presence ----------------------------------------------------------------------

    async def dead_peers(self, absent: dict[str, float], now: Callable[[], float]) -> list[str]:
        """The peers holding jobs whose control channel has had no subscriber at every poll for
        ``LLMQ_TAKEOVER_S``: their process died. ``absent`` (peer -> when first seen without a
        subscriber) is the caller's memory between polls, updated here."""
        holders = sorted(await self.registry.holders(self.model, self.worker_id))
        for gone in absent.keys() - set(holders):
            del absent[gone]
        if not holders:
            return []
        ours, *theirs = await self.registry.subscribed(self.model, [self.worker_id, *holders])
        if not ours:
            # Our own subscription is down too: so may everyone's be (Redis restarted). Judge no
            # one until we are back and they had time to be back as well.
            self.watch_from = max(self.watch_from, now() + 2 * RECONNECT_MAX_S)
            absent.clear()
            return []
        t = now()
        for peer, count in zip(holders, theirs, strict=True):
            if count:
                absent.pop(peer, None)
            else:
                absent.setdefault(peer, t)
        return [peer for peer, since in absent.items()
                if t - max(since, self.watch_from) >= self.settings.takeover_s]
