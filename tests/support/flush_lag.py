"""A worker's flusher made slower than its engine, as a loaded box makes it: each flush waits
first, so the outbox gathers several steps of each job and the steps of a job whose dialect renders
text deltas share one event (shared/chunking.py). ``LLMQ_TEST_FLUSH_LAG_MS`` sets it for a whole
test run (tests/conftest.py), to show which stream tests hold only at one chunking."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

from shared.queue import EventWriter

__all__ = ["flush_lag"]


_ON_TIME = EventWriter.flush  # as imported: a test's own lag (or none) replaces the whole run's


@contextlib.contextmanager
def flush_lag(seconds: float) -> Iterator[None]:
    """Every worker's :meth:`EventWriter.flush` ``seconds`` late (0: on time, whatever the run's lag),
    while the context lasts."""

    @functools.wraps(_ON_TIME)
    async def late(self: EventWriter, *args, **kwargs):
        if seconds:
            await asyncio.sleep(seconds)
        return await _ON_TIME(self, *args, **kwargs)

    with mock.patch.object(EventWriter, "flush", late):
        yield
