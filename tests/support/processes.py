"""Child processes whose output goes to a log file."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["spawn_logged"]


def spawn_logged(args: Sequence[str], log: Path, **popen: Any) -> subprocess.Popen:
    """``Popen(args, **popen)`` with stdout and stderr written to ``log`` (truncated). The child
    gets its own copy of the file; ours is closed at once, not left to the garbage collector."""
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **popen)
