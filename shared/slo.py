"""Deadlines under overload: what the queue knows of a model's speed, and where a waiting job stands.

- :class:`Rates`: one warm worker's measured speed, in its heartbeat (field ``rates``, JSON):
  prompt tokens per second of prefill, generated tokens per second over all its jobs, and the
  tokens a job generates on average. The worker measures them (workers/rates.py).
- :class:`Capacity`: a model's warm workers together, as admission and the ETA use them: its slots
  and its rates. The API reads it from the heartbeats (:func:`capacity_of`).
- :class:`Standing`: a waiting job's place: how many jobs of its model start before it, and when
  it should start (the queue computes both in one script: shared/lua/slo.lua).

How the prediction works, and how good it is: docs/guarantees.md#slos.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

__all__ = ["Rates", "Capacity", "UNKNOWN", "Standing", "capacity_of"]


class Rates(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's measured speed (0: not measured yet)."""

    prefill_tps: float = 0.0
    """Prompt tokens per second from a job's start to its first token (the prefill, as a job sees it)."""
    decode_tps: float = 0.0
    """Tokens per second generated over all its running jobs, while it runs any."""
    generated_per_job: float = 0.0
    """Tokens a job generated, on average over its recent jobs."""


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """A model's warm workers, together: what predicts when a waiting job starts."""

    slots: int = 0
    """Their engine slots (each worker's ``LLMQ_MAX_NUM_SEQS``)."""
    prefill_tps: float = 0.0
    """The mean of their prefill rates (a job is prefilled on one worker)."""
    decode_tps: float = 0.0
    """The sum of their decode rates."""
    generated_per_job: float = 0.0

    @property
    def known(self) -> bool:
        """Whether it predicts anything: a warm worker measured its speed. Unknown, admission
        refuses nothing (a cold pool's first requests are how it learns)."""
        return self.slots > 0 and self.decode_tps > 0 and self.generated_per_job > 0


UNKNOWN = Capacity()
"""No warm worker, or none that has measured its speed: predicts nothing, refuses nothing."""


def capacity_of(workers: Iterable[tuple[int, Rates]]) -> Capacity:
    """The capacity of ``workers`` (each: its slots, its rates), the warm ones only."""
    slots, prefill, decode, generated, measured = 0, 0.0, 0.0, 0.0, 0
    for worker_slots, rates in workers:
        slots += worker_slots
        decode += rates.decode_tps
        if rates.prefill_tps > 0 and rates.generated_per_job > 0:
            prefill += rates.prefill_tps
            generated += rates.generated_per_job
            measured += 1
    if not measured:
        return Capacity(slots=slots, decode_tps=decode)
    return Capacity(slots=slots, prefill_tps=prefill / measured, decode_tps=decode,
                    generated_per_job=generated / measured)


class Standing(msgspec.Struct, frozen=True, kw_only=True):
    """Where a waiting job stands in its model's queue."""

    position: int
    """How many jobs of its model are estimated to start before it."""
    eta_s: float | None
    """Seconds until it is estimated to start (None: no warm worker has measured its speed)."""
