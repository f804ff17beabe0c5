"""Where an unclosed asyncio stream was opened, or an unwaited child process started, in the
warning that reports it.

An ``asyncio.StreamWriter`` collected while its connection is open warns ``unclosed <StreamWriter
...>`` (a ResourceWarning, an error in this suite), but says nothing of who opened it, and the
collector may find it many tests after the one that dropped it. Each writer here remembers the
stack that opened it (a few frames: this costs microseconds, and writers are few: redis-py's
connections, the tests' raw sockets), and the warning names it, so a leak seen once can be found.

A ``subprocess.Popen`` collected before anyone waited for its child warns ``subprocess N is still
running``, as silent about its origin (once in CI, in a unit test that starts no process). Each
remembers the stack that started it in the same way.
"""

from __future__ import annotations

import asyncio
import subprocess
import traceback
import warnings

__all__ = ["name_unclosed_streams", "name_unwaited_processes"]

FRAMES = 16


def name_unclosed_streams() -> None:
    """Patch :class:`asyncio.StreamWriter` for the test session (idempotent)."""
    writer = asyncio.StreamWriter
    if getattr(writer, "_llmq_named", False):
        return
    init, collected = writer.__init__, writer.__del__

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self._llmq_opened_at = _stack()

    def __del__(self) -> None:
        opened_at = getattr(self, "_llmq_opened_at", None)
        if opened_at is None or self._transport.is_closing() or self._loop.is_closed():
            collected(self)
            return
        self.close()
        warnings.warn(f"unclosed {self!r}, opened at (most recent call last):\n"
                      f"{''.join(traceback.format_list(opened_at))}", ResourceWarning, stacklevel=1)

    writer.__init__ = __init__  # type: ignore[method-assign]
    writer.__del__ = __del__  # type: ignore[attr-defined]
    writer._llmq_named = True  # type: ignore[attr-defined]


def _stack() -> list[traceback.FrameSummary]:
    return traceback.extract_stack(limit=FRAMES)[:-2]  # neither this nor the patched __init__


def name_unwaited_processes() -> None:
    """Patch :class:`subprocess.Popen` for the test session (idempotent)."""
    popen = subprocess.Popen
    if getattr(popen, "_llmq_named", False):
        return
    init, collected = popen.__init__, popen.__del__

    def __init__(self, *args, **kwargs) -> None:
        self._llmq_started_at = _stack()
        init(self, *args, **kwargs)

    def __del__(self) -> None:
        started_at = getattr(self, "_llmq_started_at", None)
        if started_at is None:
            collected(self)
            return

        def warn(message, *args, **kwargs) -> None:  # Popen.__del__'s own warning, with the origin
            warnings.warn(f"{message}, started at (most recent call last):\n"
                          f"{''.join(traceback.format_list(started_at))}", *args, **kwargs)

        collected(self, _warn=warn)

    popen.__init__ = __init__  # type: ignore[method-assign]
    popen.__del__ = __del__  # type: ignore[method-assign]
    popen._llmq_named = True  # type: ignore[attr-defined]
