"""A dialect's stream in a test: every frame its renderer makes from a list of events, through
the one driver the API uses (:func:`api.dialects.stream.drive`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TypeVar

from api.dialects.stream import StreamRenderer, drive
from shared.events import Event
from shared.framing import Keepalive

F = TypeVar("F")


async def events_of(events: Iterable[Event | Keepalive]) -> AsyncIterator[Event | Keepalive]:
    for event in events:
        yield event


async def frames(renderer: StreamRenderer[F], events: Iterable[Event | Keepalive] | AsyncIterator[Event | Keepalive]
                 ) -> list[F]:
    """Every frame, in order (the driver's per-event lists flattened)."""
    source = events if isinstance(events, AsyncIterator) else events_of(events)
    return [frame async for chunk in drive(renderer, source) for frame in chunk]


def chunked(pieces: Sequence[str], whole: str) -> list[str]:
    """A stream's text pieces as they came, checked to be ``whole`` cut somewhere: none empty,
    joined ``whole``. How many there are depends on how far the worker's flusher lagged (a job's
    steps share an event then, shared/chunking.py), so a test of a delta dialect's stream renders
    the bytes it expects from these boundaries: a wrong byte still fails it, a different lag not."""
    assert all(pieces) and "".join(pieces) == whole, (list(pieces), whole)
    return list(pieces)
