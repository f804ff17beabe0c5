"""A worker's children die with it, SIGKILL included (workers/lifeline.py).

The real case is vLLM's engine core, a forked child of the worker (the e2e SIGKILL test checks
that one); here a plain forked child stands in, with a control run that shows the orphan the
module exists to prevent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.support.faults import alive

# A parent that (maybe) binds its children, forks one that sleeps, reports its pid, and waits.
PARENT = """
import multiprocessing, sys, time
from workers.lifeline import bind_children
if __name__ == "__main__":
    if sys.argv[1] == "bind":
        bind_children()
    # exec, a builtin, pickles by name: a spawned child does not have this script's functions.
    child = multiprocessing.get_context(sys.argv[2]).Process(
        target=exec, args=("import time; print('running', flush=True); time.sleep(60)",))
    child.start()
    print(f"pid={child.pid};", flush=True)
    time.sleep(60)
"""


def _orphan_after_sigkill(mode: str, start: str) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode, start], cwd=REPO, stdout=subprocess.PIPE, text=True)
    # Parent and child share the pipe, and their writes can interleave ("8872running\n" was seen
    # under load): read until both the pid and the child's "running" (past its start-up) are in.
    seen = ""
    while "running" not in seen or not re.search(r"pid=\d+;", seen):
        line = parent.stdout.readline()
        assert line, f"the parent ended early: {seen!r}"
        seen += line
    child = int(re.search(r"pid=(\d+);", seen).group(1))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    parent.stdout.close()  # only now: a child that outlived the parent may still write its line's end
    return child, survived


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@linux_only
@pytest.mark.parametrize("start", ["fork", "spawn"])  # vLLM forks on GPU hosts, spawns on CPU
def test_a_bound_child_dies_when_its_parent_is_sigkilled(start):
    _, survived = _orphan_after_sigkill("bind", start)
    assert not survived


@linux_only
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_without_the_binding_the_child_outlives_a_sigkilled_parent(start):
    # The control: what happened to vLLM's engine before the worker bound its children.
    _, survived = _orphan_after_sigkill("plain", start)
    assert survived
