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


def _remember_origin(cls: type, collected_with_origin) -> None:
    """Patch ``cls`` for the test session (idempotent): each instance remembers the stack that
    made it, and ``collected_with_origin(self, collected, origin)`` stands in for its ``__del__``
    (``collected``, the original; ``origin``, that stack as text)."""
    if getattr(cls, "_llmq_named", False):
        return
    init, collected = cls.__init__, cls.__del__

    def __init__(self, *args, **kwargs) -> None:
        self._llmq_origin = traceback.extract_stack(limit=FRAMES)[:-1]  # not this frame
        init(self, *args, **kwargs)

    def __del__(self) -> None:
        origin = getattr(self, "_llmq_origin", None)
        if origin is None:
            collected(self)
        else:
            collected_with_origin(self, collected, "".join(traceback.format_list(origin)))

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__del__ = __del__  # type: ignore[method-assign]
    cls._llmq_named = True  # type: ignore[attr-defined]


def _writer_collected(writer: asyncio.StreamWriter, collected, origin: str) -> None:
    if writer._transport.is_closing() or writer._loop.is_closed():
        collected(writer)
        return
    writer.close()
    warnings.warn(f"unclosed {writer!r}, opened at (most recent call last):\n{origin}", ResourceWarning,
                  stacklevel=1)


def _process_collected(proc: subprocess.Popen, collected, origin: str) -> None:
    def warn(message, *args, **kwargs) -> None:  # Popen.__del__'s own warning, with the origin
        warnings.warn(f"{message}, started at (most recent call last):\n{origin}", *args, **kwargs)

    collected(proc, _warn=warn)


def name_unclosed_streams() -> None:
    """Patch :class:`asyncio.StreamWriter` for the test session (idempotent)."""
    _remember_origin(asyncio.StreamWriter, _writer_collected)


def name_unwaited_processes() -> None:
    """Patch :class:`subprocess.Popen` for the test session (idempotent)."""
    _remember_origin(subprocess.Popen, _process_collected)
