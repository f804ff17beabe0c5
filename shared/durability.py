"""What an acknowledgement means (LLMQ_DURABILITY), and the one place that makes it so.

Redis replicates asynchronously: a primary that dies before its replicas received a job takes the
job with it, and a failover promotes a replica that never had it. Under ``replicas:N`` the enqueue
script and ``WAIT N <timeout>`` go out together in one pipeline, on the connection that wrote (WAIT
counts only that connection's writes; on a Cluster, the connection to the slot's primary), and the
client is answered only once N replicas hold the job. Fewer is :class:`NotDurable`: a 503, the job
possibly still run, so clients retry with the same Idempotency-Key.
"""

from __future__ import annotations

import re

__all__ = ["replicas_of"]

_MODE = re.compile(r"replicas:([1-9][0-9]*)")


def replicas_of(mode: str) -> int:
    """The replicas an admission waits for under LLMQ_DURABILITY ``mode``: 0 for ``none``.
    Raises ValueError for anything else."""
    mode = mode.strip().lower()
    if mode == "none":
        return 0
    if match := _MODE.fullmatch(mode):
        return int(match[1])
    raise ValueError(f"LLMQ_DURABILITY={mode!r} (none, or replicas:N with N >= 1)")
