"""The suite's leak warnings name their origin (tests/support/unclosed.py): an unclosed stream or
an unwaited child process is often collected tests after the one that dropped it."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest


def _start_and_drop() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    del proc  # never waited for


def test_an_unwaited_process_names_the_line_that_started_it():
    with pytest.warns(ResourceWarning, match=r"(?s)subprocess \d+ is still running, started at .*_start_and_drop"):
        _start_and_drop()
        gc.collect()
