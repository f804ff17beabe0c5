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

from shared.queue import Queue

__all__ = ["flush_lag"]


@contextlib.contextmanager
def flush_lag(seconds: float) -> Iterator[None]:
    """Every worker's :meth:`Queue.flush` ``seconds`` late, while the context lasts."""
    flush = Queue.flush

    @functools.wraps(flush)
    async def late(self: Queue, *args, **kwargs):
        await asyncio.sleep(seconds)
        return await flush(self, *args, **kwargs)

    with mock.patch.object(Queue, "flush", late):
        yield
