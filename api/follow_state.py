"""Where a followed job's relay stands, without I/O: the one position its two drivers share.

A job's events reach its client by two ways (:mod:`api.follow`): the awaiting loop of
:func:`api.follow.follow`, which yields what arrives live or is read from the job's log, and the
stream's lane (:class:`api.follow.Lane`), which the listener hands each live message while that
loop waits. Both must agree on one thing, the last event delivered, or an event goes out twice
or is skipped. So neither keeps a copy: both drive this object, which holds

- ``last``: the seq of the last event delivered, by either way;
- ``pending``: events held for the loop to deliver, in the order they came (a live message, or
  a read of the log), duplicates still among them;
- ``done``: the terminal event has been delivered; nothing comes after it.

It decides, and does nothing: where a live event falls (:meth:`place`), which held event goes out
next (:meth:`pop`), and that one went out by the lane (:meth:`sent`). Reading the log, waiting,
decoding and writing stay with the drivers. Only the loop holds and pops; the lane takes an event
only while the loop waits with nothing held, so the two never interleave on ``pending``.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from shared.events import Event, is_terminal

__all__ = ["FollowState", "Place"]

Place = Literal["next", "end", "duplicate", "gap"]
"""Where a live event falls: the next one (``end`` when it is the terminal one), one already
delivered, or past a gap (the events between are in the log)."""


class FollowState:
    """One followed job's position: what was delivered, what is held to deliver, whether it ended."""

    __slots__ = ("last", "pending", "done")

    def __init__(self, after_seq: int = 0) -> None:
        self.last = after_seq  # a resume starts after the client's Last-Event-ID
        self.pending: deque[Event] = deque()
        self.done = False

    def place(self, event: Event) -> Place:
        """Where live ``event`` falls after ``last`` (the state is not changed)."""
        if self.done or event.seq <= self.last:
            return "duplicate"
        if event.seq > self.last + 1:
            return "gap"
        return "end" if is_terminal(event) else "next"

    def hold(self, event: Event) -> None:
        """Keep ``event`` for :meth:`pop` (a live one in order; a duplicate is dropped there)."""
        self.pending.append(event)

    def fill(self, events: list[Event]) -> None:
        """Keep the log's events after ``last`` for :meth:`pop`, which drops any the lane sent
        meanwhile."""
        self.pending.extend(events)

    def pop(self) -> Event | None:
        """The next held event to deliver, now counted as delivered; None when none is left.
        After the terminal event nothing is: ``done`` is set and the rest is dropped."""
        pending = self.pending
        while pending:
            event = pending.popleft()
            if event.seq <= self.last:
                continue  # a duplicate: already delivered live or from the log
            self.last = event.seq
            if is_terminal(event):
                self.done = True
                pending.clear()
            return event
        return None

    def sent(self, event: Event) -> None:
        """``event`` went out by the lane (which sends only what :meth:`place` calls ``next``)."""
        self.last = event.seq
