"""Children die with the worker: a SIGKILLed worker must not leave its vLLM engine behind.

vLLM runs the engine core in a child process. When the worker exits normally it shuts that
child down; when the worker is SIGKILLed (OOM killer, ``kill -9``, a node agent) nothing does,
and the orphan keeps its memory (a whole GPU, on a GPU host) and its CPU while a replacement
worker starts next to it. Measured here before this module: every SIGKILL left one
``VLLM::EngineCore`` (parent pid 1, ~1 GB) running until someone killed it by hand.

Linux's ``PR_SET_PDEATHSIG`` asks the kernel to signal a process when its parent dies, whatever
the cause. It must be armed in the child itself, so it is done in both ways vLLM starts one:

- **fork** (vLLM's default, GPU hosts): ``fork`` clears the setting, so an at-fork hook arms it
  in every child the worker forks;
- **spawn** (forced by vLLM's CPU platform): no Python runs in the child before it execs, but
  multiprocessing's spawn imports the parent's main module in the child. The worker's main
  module is a package ``__main__``, which spawn skips, so :func:`bind_children` names this module
  as the main module instead, and importing it under spawn's name ``__mp_main__`` arms the signal.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import sys

__all__ = ["bind_children"]

_PR_SET_PDEATHSIG = 1
# The forking process's pid, recorded just before each fork: after the fork the child compares
# it with its parent pid, which differs only if the parent died before the signal was armed.
_forking_pid = [0]


def die_with_parent(parent_pid: int | None = None) -> None:
    """Arm SIGKILL-on-parent-death for this process (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not permitted in some sandboxes: the engine then outlives a SIGKILL, as before
    # The parent may have died between the fork and the prctl: then no signal will ever come.
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _before_fork() -> None:
    _forking_pid[0] = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking_pid[0])


def bind_children() -> None:
    """From now on every child this process forks is killed when this process dies. Call once,
    before the engine starts. The kernel sends the signal when the *thread* that forked the child
    exits; vLLM starts its engine from the caller's thread, here the worker's main thread."""
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    # What spawn's children import as their main module (multiprocessing.spawn.get_preparation_data
    # reads the name from the main module's spec).
    sys.modules["__main__"].__spec__ = importlib.util.find_spec(__name__)


if __name__ == "__mp_main__":  # imported by a child that multiprocessing spawned from the worker
    # Its parent pid is not known here; reparented to init means the worker is already gone.
    die_with_parent()
    if os.getppid() == 1:
        os._exit(1)
