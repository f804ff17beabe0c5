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


def _named(check: Callable[[], Any], what: What) -> str:
    if callable(what):
        return what()
    return what or getattr(check, "__qualname__", None) or repr(check)


def _failure(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"waited {timeout_s} s for {what}; last seen: {last!r}")


async def eventually(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
                     what: What = None, ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """``check``'s first truthy result. ``ignoring``: exceptions that count as "not yet" (a server
    still starting); any other exception fails at once."""
    last: object = None
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            while True:
                try:
                    value = check()
                    if inspect.isawaitable(value):
                        value = await value
                except ignoring as exc:
                    last = exc
                else:
                    if value:
                        return value
                    last = value
                await asyncio.sleep(interval_s)
    except TimeoutError:
        if not deadline.expired():
            raise  # the check's own timeout, not ours
        raise _failure(_named(check, what), timeout_s, last) from None


def eventually_sync(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
                    what: What = None, ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """:func:`eventually` for synchronous code: blocks the thread between calls."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = check()
        except ignoring as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise _failure(_named(check, what), timeout_s, last)
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
