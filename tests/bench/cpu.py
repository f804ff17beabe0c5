"""CPU time by process role: what each part of a deployment spends per generated token.

A target is a few root processes, each given a role (llmq: ``api``, ``worker``, ``redis``,
``housekeeping``; ``vllm serve``: ``api-server``). Every process under a root takes the root's
role, except vLLM's engine processes: vLLM titles them ``VLLM::EngineCore`` (the scheduler and,
with one engine process, the model) and ``VLLM::Worker`` (the model, when the executor runs it in
processes of its own), and those and their children count as ``engine``, so the engine's CPU is
kept apart from the front end that feeds it, whichever server holds that front end.

A process's CPU is its ``utime + stime`` from ``/proc/<pid>/stat`` (every thread of it, not its
reaped children): read before and after a run, the difference is what the run cost. A process
born during the run counts from zero; one that ended during it is lost (its time went to its
parent's ``cutime``, which is not read), so targets keep their processes for the whole benchmark.
Linux only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

__all__ = ["ENGINE", "ProcessCpu", "CpuMeter", "cpu_seconds", "children_map", "children", "title", "by_role",
           "per_token_us"]

ENGINE = "engine"
ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker")

_TICK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


class ProcessCpu(msgspec.Struct, frozen=True):
    """One process at one moment: its role, its title and the CPU seconds it has used."""

    pid: int
    role: str
    title: str
    cpu_s: float


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the ``(comm)`` one, which may hold spaces and
    parentheses itself; None if the process is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2:].decode().split()


def cpu_seconds(pid: int) -> float | None:
    """``utime + stime`` of ``pid`` in seconds (fields 14 and 15 of stat); None if gone."""
    f = _stat_fields(pid)
    # After "(comm)": state is field 3, so utime (14) and stime (15) are at 11 and 12 here.
    return None if f is None else (int(f[11]) + int(f[12])) / _TICK


def title(pid: int) -> str:
    """What the process calls itself: vLLM's ``setproctitle`` title, else its command line."""
    try:
        cmdline = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    # setproctitle overwrites argv in place: the title, then NULs (or spaces) as padding.
    return " ".join(part.decode(errors="replace") for part in cmdline.split(b"\0") if part).strip()


def children_map() -> dict[int, list[int]]:
    """Every live process's children, from one pass over ``/proc/*/stat`` (ppid is field 4)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        f = _stat_fields(int(entry.name))
        if f is not None:
            children.setdefault(int(f[1]), []).append(int(entry.name))
    return children


def children(pid: int) -> list[int]:
    """``pid``'s live children, in pid order."""
    return sorted(children_map().get(pid, []))


def _is_engine(text: str) -> bool:
    return text.startswith(ENGINE_TITLES)


class CpuMeter:
    """Samples the process trees of named roots. ``roots``: role -> root pid."""

    def __init__(self, roots: Mapping[str, int]) -> None:
        self.roots = dict(roots)

    def sample(self) -> list[ProcessCpu]:
        """Every live process of every tree now, with its role. A process found under two roots
        (it cannot be, short of pid reuse) is counted once, under the first."""
        children = children_map()
        seen: set[int] = set()
        out: list[ProcessCpu] = []
        for role, root in self.roots.items():
            stack = [(root, role)]
            while stack:
                pid, inherited = stack.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                cpu = cpu_seconds(pid)
                if cpu is None:
                    continue
                name = title(pid)
                own = ENGINE if _is_engine(name) or inherited == ENGINE else inherited
                out.append(ProcessCpu(pid=pid, role=own, title=name[:80], cpu_s=cpu))
                stack.extend((child, own) for child in children.get(pid, ()))
        return out


def by_role(before: Iterable[ProcessCpu], after: Iterable[ProcessCpu]) -> dict[str, float]:
    """CPU seconds each role used between two samples. Processes match by (pid, title): a pid
    reused by another process between the samples counts from zero, as a new one does."""
    start = {(p.pid, p.title): p.cpu_s for p in before}
    used: dict[str, float] = {}
    for p in after:
        used[p.role] = used.get(p.role, 0.0) + max(0.0, p.cpu_s - start.get((p.pid, p.title), 0.0))
    return {role: round(s, 4) for role, s in sorted(used.items())}


def per_token_us(cpu_s: Mapping[str, float], tokens: int) -> dict[str, float | None]:
    """Each role's CPU per generated token in microseconds, plus ``outside engine`` (every role but
    the engine) and ``total``; None for every figure when no token was generated."""
    rows = dict(cpu_s)
    rows["outside engine"] = sum(s for r, s in cpu_s.items() if r != ENGINE)
    rows["total"] = sum(cpu_s.values())
    return {r: (round(s * 1e6 / tokens, 1) if tokens else None) for r, s in rows.items()}
