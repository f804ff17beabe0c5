"""CPU time by process role (tests/bench/cpu.py) on real processes: a busy child is attributed
to its root's role, a child titled as vLLM's engine to ``engine``, and the report turns the
seconds into µs per token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed
# The busy children title themselves with it (as vLLM does); without it they die on import and the
# test would wait for their "burnt" lines until its timeout.
pytest.importorskip("setproctitle")

from tests.bench.cpu import ENGINE, CpuMeter, ProcessCpu, by_role, cpu_seconds, per_token_us, title

pytestmark = pytest.mark.engine

BURN_S = 0.3  # CPU seconds each busy child uses before it reports

# A busy process: optionally titled (setproctitle, as vllm.utils.system_utils titles vLLM's
# engine processes), optionally starting one plain busy child of its own; it burns BURN_S of its
# own CPU, says so, then sleeps. argv: title or "-"; "child" or "-"; this script (for the child).
BURN = textwrap.dedent(f"""
    import os, subprocess, sys, time
    if sys.argv[1] != "-":
        import setproctitle
        setproctitle.setproctitle(sys.argv[1])
    if sys.argv[2] == "child":
        subprocess.Popen([sys.executable, "-c", sys.argv[3], "-", "-", ""])
    while time.process_time() < {BURN_S}:
        pass
    os.write(1, b"burnt\\n")  # one write: three processes share the pipe (print may write twice)
    time.sleep(60)
""")
# The root: a plain busy child and an engine-titled one with a child of its own; it only waits.
ROOT = textwrap.dedent("""
    import subprocess, sys
    burn = sys.argv[1]
    kids = [subprocess.Popen([sys.executable, "-c", burn, "-", "-", burn]),
            subprocess.Popen([sys.executable, "-c", burn, "VLLM::EngineCore", "child", burn])]
    print("started", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def tree():
    root = subprocess.Popen([sys.executable, "-c", ROOT, BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert root.stdout is not None
        assert root.stdout.readline() == "started\n"
        yield root, idle
    finally:
        os.killpg(root.pid, signal.SIGKILL)  # the root, its children and the engine's child
        root.wait(10)
        root.stdin.close()
        root.stdout.close()
        assert idle.stdin is not None
        idle.stdin.close()
        idle.wait(10)


def test_a_busy_child_counts_for_its_roots_role_and_vllms_titled_processes_for_the_engine(tree):
    root, idle = tree
    meter = CpuMeter({"worker": root.pid, "redis": idle.pid})
    before = meter.sample()
    assert root.stdout is not None
    assert [root.stdout.readline() for _ in range(3)] == ["burnt\n"] * 3  # three busy processes done
    after = meter.sample()

    # The root and its plain child are the worker; the titled child and its own child the engine.
    assert sorted(p.role for p in after) == [ENGINE, ENGINE, "redis", "worker", "worker"]
    assert sorted(p.title.split(" ")[0] for p in after if p.role == ENGINE) == [sys.executable, "VLLM::EngineCore"]
    assert [p.pid for p in after if p.role == "redis"] == [idle.pid]
    assert root.pid in [p.pid for p in after if p.role == "worker"]

    used = by_role(before, after)
    assert list(used) == [ENGINE, "redis", "worker"]  # sorted by role
    # Processes born before the first sample count from there, so each busy one gave at most
    # BURN_S; the engine's two together more than one's, the worker about one's, redis nothing.
    assert BURN_S < used[ENGINE] <= 2 * BURN_S + 0.05
    assert 0 < used["worker"] <= BURN_S + 0.1
    assert used["redis"] < 0.05


def test_cpu_seconds_and_title_read_this_process():
    import time

    start = cpu_seconds(os.getpid())
    assert start is not None
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - start >= 0.03  # clock ticks of 10 ms
    assert "pytest" in title(os.getpid()) or "python" in title(os.getpid())
    assert cpu_seconds(2**22 + 1) is None and title(2**22 + 1) == ""  # above pid_max's default: no such process


def test_by_role_counts_new_processes_from_zero_and_a_reused_pid_as_new():
    before = [ProcessCpu(1, "api", "python -m api", 5.0), ProcessCpu(2, ENGINE, "VLLM::EngineCore", 7.0),
              ProcessCpu(3, "worker", "old", 9.0)]
    after = [ProcessCpu(1, "api", "python -m api", 5.25), ProcessCpu(2, ENGINE, "VLLM::EngineCore", 8.0),
             ProcessCpu(3, "worker", "new", 0.5), ProcessCpu(4, "worker", "python -m workers", 0.125)]
    # pid 3 ended and its pid went to another process (a different title): counted from zero.
    assert by_role(before, after) == {"api": 0.25, ENGINE: 1.0, "worker": 0.625}


def test_per_token_figures_split_the_engine_from_the_rest():
    assert per_token_us({"api": 0.018, "worker": 0.033, "redis": 0.006, ENGINE: 0.2}, 1000) == {
        "api": 18.0, "worker": 33.0, "redis": 6.0, ENGINE: 200.0, "outside engine": 57.0, "total": 257.0}
    assert per_token_us({"api": 1.0}, 0) == {"api": None, "outside engine": None, "total": None}
