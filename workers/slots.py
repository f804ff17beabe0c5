"""A worker's engine slots: how many jobs it runs at once, and who holds the rest.

Two tasks claim jobs concurrently, the reader (new and lapsed-lease jobs) and the watcher (a dead
peer's), and neither may fill a slot the other counted as free. So a claim first reserves the
slots it asks for (:meth:`Slots.reserve`), holds them while it claims, fills one per job it
starts, and gives the rest back when it is done: nothing is claimed that could not start. A
reader about to block holds nothing (it reserves again once woken), so a takeover meanwhile can
use every slot. The role of streaq's ``CapacityLimiter``, for two kinds of borrower.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["Slots", "Reservation"]


class Reservation:
    """Slots held for jobs being claimed: :meth:`fill` one per job that starts; the rest go back
    when the reservation ends."""

    __slots__ = ("_slots", "held")

    def __init__(self, slots: Slots, held: int) -> None:
        self._slots = slots
        self.held = held
        """How many it still holds."""

    def fill(self) -> None:
        """One held slot now runs a job (until :meth:`Slots.free`)."""
        assert self.held > 0, "a job started without a slot reserved for it"
        self.held -= 1
        self._slots._reserved -= 1
        self._slots._running += 1


class Slots:
    """``total`` engine slots: running (a job holds each until :meth:`free`), reserved (by a
    claim in progress) or available."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._running = 0
        self._reserved = 0
        self._freed = asyncio.Event()

    @property
    def running(self) -> int:
        return self._running

    @property
    def available(self) -> int:
        return self.total - self._running - self._reserved

    def reserve(self, wanted: int) -> contextlib.AbstractContextManager[Reservation]:
        """Hold up to ``wanted`` of the available slots (maybe none: see ``held``) for the
        duration of the block; whatever is not filled by then is available again."""
        return self._holding(max(0, min(wanted, self.available)))

    def pass_on(self) -> contextlib.AbstractContextManager[Reservation]:
        """A running job's slot, for the job that takes its place (a preemption): held as a
        reservation of one from now, while the job that gave it up stops (its end frees nothing);
        available again if the reservation ends unfilled."""
        assert self._running > 0, "no running job's slot to pass on"
        self._running -= 1
        return self._holding(1)

    @contextlib.contextmanager
    def _holding(self, held: int) -> Iterator[Reservation]:
        reservation = Reservation(self, held)
        self._reserved += held
        try:
            yield reservation
        finally:
            if reservation.held:
                self._reserved -= reservation.held
                reservation.held = 0
                self._freed.set()

    def free(self) -> None:
        """A job ended: its slot is available."""
        assert self._running > 0, "a slot freed twice"
        self._running -= 1
        self._freed.set()

    async def wait_free(self, stop: asyncio.Event) -> None:
        """Return once a slot is available, or at once when ``stop`` is set."""
        while self.available <= 0 and not stop.is_set():
            self._freed.clear()
            freed, stopped = asyncio.ensure_future(self._freed.wait()), asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({freed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                freed.cancel()
                stopped.cancel()
