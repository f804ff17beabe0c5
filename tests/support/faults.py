"""The fault suite's figures: each fault scenario records what it sent and what arrived, and the
session prints one table (and writes ``faults.json``) so the figures in docs/guarantees.md come from a run.

A scenario asserts its own figures (0 lost, 0 duplicated); the table is the report.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Figures", "FIGURES", "write_table", "lost_and_duplicated", "alive", "children"]


@dataclass
class Figures:
    scenario: str
    requests_sent: int = 0
    completed: int = 0
    ended_with_error: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    jobs_lost: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    """Named timings, e.g. ``slot_free_s`` or ``recovery_s``."""
    counts: dict[str, int] = field(default_factory=dict)
    """Named counts a scenario reports beyond the columns above, e.g. ``refused_503``."""


FIGURES: list[Figures] = []


def lost_and_duplicated(expected: list, got: list) -> tuple[int, int]:
    """Compare a stream with what it should have been, position by position: tokens that did not
    arrive where they belong are lost; tokens beyond the expected length are duplicates."""
    matched = sum(1 for a, b in zip(expected, got, strict=False) if a == b)
    return len(expected) - matched, max(0, len(got) - len(expected))


def write_table(path: Path) -> str:
    rows = sorted(FIGURES, key=lambda f: f.scenario)
    path.write_text(json.dumps([asdict(f) for f in rows], indent=2) + "\n")
    head = ("scenario", "sent", "completed", "errors", "tokens lost", "tokens dup", "jobs lost", "timings", "counts")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for f in rows:
        timings = ", ".join(f"{k}={v:.2f}" for k, v in f.seconds.items())
        counts = ", ".join(f"{k}={v}" for k, v in f.counts.items())
        lines.append(" | ".join(str(x) for x in (f.scenario, f.requests_sent, f.completed, f.ended_with_error,
                                                  f.tokens_lost, f.tokens_duplicated, f.jobs_lost, timings, counts)))
    return "\n".join("| " + line + " |" for line in lines)


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or being reaped as we read (ESRCH)
        return False


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (vLLM's engine core is a forked child of its worker)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat(entry)[1]) == pid:
                    found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found
