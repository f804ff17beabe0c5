"""Every Redis key and channel name llmq uses. Nothing else formats a key.

Per-model keys carry the model in a Cluster hash tag (``{model}``), so the multi-key commands
and transactions that touch one job (record + queue + event log) stay in one slot.
"""

from __future__ import annotations

__all__ = ["Keys", "GROUP", "LEVELS"]

# The consumer group every worker of a model reads the queue through.
GROUP = "workers"
# Priority levels: one queue stream per level, read in order (0 first). A constant, not a setting,
# so an API and a worker can never disagree about which streams exist.
LEVELS = 3


class Keys:
    """Key names under one prefix (default ``llmq``; tests use a fresh prefix per run)."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str = "llmq") -> None:
        self.prefix = prefix

    def _model(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}"

    def queue(self, model: str, level: int = 0) -> str:
        """Stream: one entry per queued job, read through group ``workers``; level 0 (the default
        priority) is ``...:queue``, lower priorities ``...:queue:1`` and ``...:queue:2``."""
        return f"{self._model(model)}:queue" + (f":{level}" if level else "")

    def queues(self, model: str) -> list[str]:
        """Every level's queue, in reading order (most urgent first)."""
        return [self.queue(model, level) for level in range(LEVELS)]

    def job(self, model: str, job_id: str) -> str:
        """Hash: the job record (status, request, timestamps, worker, attempt, result, error)."""
        return f"{self._model(model)}:job:{job_id}"

    def events(self, model: str, job_id: str) -> str:
        """Stream: the job's event log; entry ids are ``<seq>-0`` so XRANGE resumes by sequence."""
        return f"{self._model(model)}:events:{job_id}"

    def live(self, model: str, job_id: str) -> str:
        """Pub/sub channel: the same events as the log, live."""
        return f"{self._model(model)}:live:{job_id}"

    def idempotency(self, model: str, key: str) -> str:
        """String: Idempotency-Key -> job id."""
        return f"{self._model(model)}:idem:{key}"

    def dead(self, model: str) -> str:
        """Stream: jobs that failed too many deliveries."""
        return f"{self._model(model)}:dead"

    def workers(self, model: str) -> str:
        """Sorted set: ready worker id -> heartbeat expiry (ms); how the API knows it can serve."""
        return f"{self._model(model)}:workers"

    def models(self) -> str:
        """Sorted set: model name -> latest heartbeat expiry (ms) of any worker serving it."""
        return f"{self.prefix}:models"

    def worker(self, worker_id: str) -> str:
        """Hash with TTL: one worker's heartbeat (model, slots, running, host, pid, started)."""
        return f"{self.prefix}:worker:{worker_id}"

    def worker_pattern(self) -> str:
        """SCAN pattern matching every worker's heartbeat key (the control channels are no keys)."""
        return f"{self.prefix}:worker:*"

    def worker_id(self, key: str) -> str:
        """The worker id in a heartbeat key (the inverse of :meth:`worker`)."""
        return key.removeprefix(f"{self.prefix}:worker:")

    def api_home(self, instance: object) -> str:
        """Pub/sub channel each API process stays subscribed to (keeps its listener in pub/sub mode)."""
        return f"{self.prefix}:api:{instance}"

    def arq_queue(self) -> str:
        """arq's sorted set for the housekeeping process (background work, never the hot path)."""
        return f"{self.prefix}:arq:queue"

    def worker_control(self, worker_id: str) -> str:
        """Pub/sub channel: job ids the worker must abort (cancellation travels through Redis)."""
        return f"{self.prefix}:worker:{worker_id}:control"
