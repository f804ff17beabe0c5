"""Waiting for something to become true: the one polling loop of the tests.

``await eventually(check)`` calls ``check`` (a plain function, or one returning an awaitable: a
coroutine function, or a lambda around a coroutine call) every ``interval_s`` until it returns
something truthy, and returns that. Past ``timeout_s`` (which also bounds a call that hangs) it
fails with an ``AssertionError`` that names what it waited for (``what``: a string, or a function
that tells it when it fails, such as a process's log tail) and the last value it saw.
:func:`eventually_sync` is the same for synchronous code (process fixtures, threads); it cannot
interrupt a call that hangs. :func:`job_status` waits for a job's status through the API.

Wait for what the test is about (a status, an event, a log line), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import httpx

from shared.schemas import TERMINAL_STATUSES

__all__ = ["eventually", "eventually_sync", "job_status"]

What = str | Callable[[], str] | None


class _Tries:
    """What both loops keep: the last value seen (an ignored exception counts as one), and the
    failure that names what they waited for."""

    def __init__(self, check: Callable[[], Any], what: What, timeout_s: float,
                 ignoring: tuple[type[BaseException], ...]) -> None:
        self.check, self.what, self.timeout_s, self.ignoring = check, what, timeout_s, ignoring
        self.last: object = None

    def __enter__(self) -> _Tries:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if kind is not None and issubclass(kind, self.ignoring):
            self.last = exc
            return True  # not yet
        return False

    def failure(self) -> AssertionError:
        what = self.what() if callable(self.what) else self.what
        what = what or getattr(self.check, "__qualname__", None) or repr(self.check)
        return AssertionError(f"waited {self.timeout_s} s for {what}; last seen: {self.last!r}")


async def eventually(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
                     what: What = None, ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """``check``'s first truthy result. ``ignoring``: exceptions that count as "not yet" (a server
    still starting); any other exception fails at once."""
    tries, deadline = _Tries(check, what, timeout_s, ignoring), asyncio.timeout(timeout_s)
    try:
        async with deadline:
            while True:
                with tries:
                    value = check()
                    tries.last = await value if inspect.isawaitable(value) else value
                    if tries.last:
                        return tries.last
                await asyncio.sleep(interval_s)
    except TimeoutError:
        if not deadline.expired():
            raise  # the check's own timeout, not ours
        raise tries.failure() from None


def eventually_sync(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
                    what: What = None, ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """:func:`eventually` for synchronous code: blocks the thread between calls."""
    tries, deadline = _Tries(check, what, timeout_s, ignoring), time.monotonic() + timeout_s
    while True:
        with tries:
            tries.last = check()
            if tries.last:
                return tries.last
        if time.monotonic() >= deadline:
            raise tries.failure()
        time.sleep(interval_s)


async def job_status(client: httpx.AsyncClient, job_id: str, *statuses: str, timeout_s: float = 20.0) -> dict:
    """The job's view (``GET /v1/jobs/{id}``) once its status is one of ``statuses`` (none named:
    once it ended)."""
    wanted = set(statuses) or TERMINAL_STATUSES

    async def view() -> dict | None:
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        return job if job["status"] in wanted else None
    return await eventually(view, timeout_s=timeout_s, interval_s=0.02,
                            what=f"job {job_id} to be {' or '.join(sorted(wanted))}")
