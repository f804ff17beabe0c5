"""An engine's rank processes, watched from the worker: when the first of them exited.

An engine of several ranks (tensor × pipeline, docs/operations.md#sizing) runs each rank in a
process of its own, a child of vLLM's engine core. Its engine core exits with 1 after any fatal
error, so its exit code cannot tell the worker's two kinds of death apart (workers/runner.py
recovery): a step that raised (its requests are the suspects) and a rank killed from outside
(nobody's doing). Their order can: a step that raises reaches the worker as the engine's death
while every rank still runs (the engine core reports it first and stops its ranks after), whereas a
killed rank is gone before its engine core notices. So the worker watches its ranks through
pidfds, which work for a grandchild, and :meth:`Ranks.gone_before` compares.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Ranks"]

_RANK_TITLE = "VLLM::Worker"  # vLLM titles its rank processes VLLM::Worker_TP0, VLLM::Worker_PP1_TP0, ...


def _children(parents: set[int]) -> list[int]:
    """The processes whose parent is one of ``parents`` (from /proc: no psutil in a worker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        # The command sits in parentheses and may hold spaces: the fields after its last ")".
        ppid = int(text.rpartition(")")[2].split()[1])
        if ppid in parents:
            found.append(int(stat.parent.name))
    return sorted(found)


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


class Ranks:
    """The rank processes under ``cores`` (the engine core pids), watched on a daemon thread."""

    def __init__(self, cores: Iterable[int]) -> None:
        self.pids = [pid for pid in _children(set(cores)) if _title(pid).startswith(_RANK_TITLE)]
        self.exited_at: float | None = None
        """time.monotonic() when the first rank was seen gone (None: all run)."""
        self._fds: list[int] = []
        for pid in self.pids:
            try:
                self._fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                self.exited_at = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        if self._fds:
            self._thread = threading.Thread(target=self._watch, name="engine-ranks", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        readable, _, _ = select.select([*self._fds, self._wake_r], [], [])
        if self._wake_r not in readable:  # a pidfd is readable once its process has exited
            self.exited_at = time.monotonic()

    def gone_before(self, moment: float) -> bool:
        """Whether a rank had exited before ``moment`` (time.monotonic())."""
        return self.exited_at is not None and self.exited_at < moment

    def close(self) -> None:
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds.clear()
        self._wake_r = self._wake_w = -1
