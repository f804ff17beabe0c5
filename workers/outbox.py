"""The worker's unsent events: queued by its job tasks, written by one flusher, in order.

The runner (workers/runner.py) hands each event here as its job's attempt makes it
(:meth:`Outbox.add` for a token event, :meth:`Outbox.end` for a job's last) and never touches it
again. The flusher (:meth:`Outbox.run`) writes whatever is queued in one round trip per batch
(``Consumer.flush``), so the events every job task made from the same engine step go out together.

While a batch is being written, a job's next steps may join its token event still queued here
(``Attempt.on_step``'s ``join``, for a dialect that renders text deltas: shared/chunking.py). A
queued token event stays *open* to those steps until it is *sealed*: when the flusher takes the
batch, or when a later event of the same job is queued. Sealing asks the event's attempt for its
final bytes (``Attempt.sealed``), which also closes the attempt's open event, so the attempt itself
knows whether a step may still join it: the runner asks nothing of the outbox for that.

A flush that Redis refuses is retried until it is written (nothing is dropped, only delayed).
A failover can take the last events of a job back from its log; the outbox then writes them again
from the attempt's own bytes (:meth:`Outbox._refill`). A job it cannot mend, and a job whose write
the fence refused (a peer owns it now), is reported through ``lose``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from shared.queue import Consumer, Delivery, Outbound
from shared.redis import REDIS_DOWN

if TYPE_CHECKING:
    from shared.events import Event
    from workers.attempt import Attempt, Emission

__all__ = ["Outbox"]

log = structlog.get_logger()


class Outbox:
    """The events on their way out of one worker, and the flusher that writes them."""

    def __init__(self, queue: Consumer, model: str, worker_id: str, lose: Callable[[list[str]], None]) -> None:
        self._queue = queue
        self._model = model
        self._worker_id = worker_id
        self._lose = lose
        """Told the jobs a flush found lost: a peer owns them now, nothing more is written of them."""
        self._events: list[Outbound] = []
        self._open: dict[str, tuple[Outbound, Attempt]] = {}
        """Per job, its last token event while it is queued, with its attempt: later steps of the
        job may join it until it is sealed (:meth:`_seal`)."""
        self._ends_unwritten = 0
        """Terminal events queued or being written: their jobs' slots are free in the worker, while
        Redis still counts them running (:meth:`write_ends`)."""
        self._ready = asyncio.Event()
        self._closing = False  # set after the worker's drain: the flusher exits once all is written
        self._lock = asyncio.Lock()  # one flush at a time: a job's events reach Redis in order

    # --- queueing ---------------------------------------------------------------------------

    def add(self, d: Delivery, attempt: Attempt, out: Emission, *, joinable: bool) -> None:
        """Queue the token event ``out`` of ``attempt`` at job ``d``: its bytes only, no event
        object (the usual entry). ``joinable``: the job's steps may join it (its dialect's stream
        renders text deltas, shared/chunking.py), so it stays open to them until sealed; any other
        event is final as it is, and costs the flusher nothing more."""
        self._seal(d.job_id)
        outbound = Outbound(d.job_id, out.seq, out.data, attempt=d.attempt, level=d.level,
                            first_token_at=out.first_token_at, prompt_ids=out.prompt_ids, history=attempt.encoded,
                            history_from=attempt.base, history_prompt_ids=attempt.logged_prompt_ids)
        self._events.append(outbound)
        self._ready.set()
        if joinable:
            self._open[d.job_id] = (outbound, attempt)

    def end(self, d: Delivery, event: Event, **extra: Any) -> None:
        """Queue ``event``, which ends job ``d``, with what its write also carries (``extra``:
        :class:`~shared.queue.Outbound`'s fields; the attempt and level default to ``d``'s)."""
        self._seal(d.job_id)
        extra.setdefault("attempt", d.attempt)
        extra.setdefault("level", d.level)
        self._events.append(out := Outbound.of(d.job_id, event, **extra))
        self._ends_unwritten += out.terminal
        self._ready.set()

    def _seal(self, job_id: str) -> None:
        """The job's open event takes no more steps: its bytes, with every step that joined it,
        are final (before any later event of the job, and before a flush)."""
        unsent = self._open.pop(job_id, None)
        if unsent is not None:
            out, attempt = unsent
            out.data = attempt.sealed(out.seq)

    def _take(self) -> list[Outbound]:
        """Everything queued, sealed: from here these events are being written (perhaps again, on
        a retry), and no later step joins them."""
        batch, self._events = self._events, []
        for job_id in list(self._open):
            self._seal(job_id)
        return batch

    # --- writing ----------------------------------------------------------------------------

    async def run(self) -> None:
        """The flusher: write what is queued, batch after batch, until :meth:`close` and empty."""
        while True:
            await self._ready.wait()
            # Let every job task woken by the same engine step add its tokens first.
            await asyncio.sleep(0)
            self._ready.clear()
            await self.flush()
            if self._closing and not self._events:
                return

    def close(self) -> None:
        """Nothing more will be queued: :meth:`run` returns once what is queued is written (it is
        never cancelled, which could drop a batch mid-write)."""
        self._closing = True
        self._ready.set()

    async def flush(self) -> None:
        """Write what is queued now, retrying until Redis takes it."""
        async with self._lock:
            batch = self._take()
            if not batch:
                return
            ends = sum(out.terminal for out in batch)
            delay = 0.1
            while batch:
                try:
                    flushed = await self._queue.flush(self._model, batch, self._worker_id)
                    self._lose(flushed.lost)
                    batch = self._refill(batch, flushed.gaps)
                except REDIS_DOWN as exc:
                    # Keep the batch: events are never dropped, only delayed until Redis is back.
                    # (flush.lua skips events already logged, so a retried batch writes nothing twice.)
                    log.warning("redis_flush_failed", events=len(batch), retry_in_s=delay, error=str(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            self._ends_unwritten -= ends

    async def write_ends(self) -> None:
        """Before a pick or a preemption check: the ends of the jobs whose slots just freed are
        written first, so the fair share sees them ended (their tenants' running jobs and
        counters) and gives no slot a preemption would take back at once."""
        if self._ends_unwritten:
            await self.flush()

    async def until_empty(self) -> None:
        """Until every event queued so far is written (one under way included): before a
        continuation reads the log, or a peer continues after it."""
        while self._events or self._lock.locked():
            await self.flush()

    def _refill(self, batch: list[Outbound], gaps: dict[str, int]) -> list[Outbound]:
        """The events to flush again for jobs whose log lacks events a failover took back (its
        replica never received them): those events first, from the attempt's own record, then
        the job's events of ``batch``, none of which was written. A job whose missing events came
        before this attempt cannot be mended here: it is let go, and a successor continues it from
        what the log holds, as a crashed worker's job."""
        again: list[Outbound] = []
        for job_id, logged in gaps.items():
            own = [out for out in batch if out.job_id == job_id]
            first = own[0]
            # Mended only from this attempt's own events (an event made without them, a dead
            # letter's, holds none): a missing one before them cannot be written here.
            if logged < first.history_from or first.seq - 1 - first.history_from > len(first.history):
                log.warning("event_log_gap", job_id=job_id, logged=logged, next_seq=first.seq, mended=False)
                self._lose([job_id])
                continue
            log.warning("event_log_gap", job_id=job_id, logged=logged, next_seq=first.seq, mended=True)
            again += [first.replay(seq) for seq in range(logged + 1, first.seq)] + own
        return again
