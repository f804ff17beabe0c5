"""An engine's ranks watched from the worker (workers/ranks.py), and a follower's watch of its
leader (workers/follower.py): real processes standing in for vLLM's, titled as vLLM titles them."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from shared.config import load_settings
from workers import follower
from workers.ranks import Ranks

# A stand-in engine core: two children titled as vLLM's ranks, one that is not, then it waits.
CORE = """
import subprocess, sys, time
for title in ("VLLM::Worker_TP0", "VLLM::Worker_TP1", "helper"):
    subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 600"])
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture
def core():
    proc = subprocess.Popen([sys.executable, "-c", CORE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    time.sleep(0.2)  # the children's exec
    yield proc
    subprocess.run(["pkill", "-9", "-P", str(proc.pid)], check=False)
    proc.kill()
    proc.wait(10)
    proc.stdout.close()


def test_the_ranks_are_the_cores_children_titled_as_vllms_and_their_first_exit_is_timed(core):
    ranks = Ranks([core.pid])
    try:
        assert len(ranks.pids) == 2, "the helper is not a rank"
        before = time.monotonic()
        time.sleep(0.05)
        assert not ranks.gone_before(time.monotonic())
        subprocess.run(["kill", "-9", str(ranks.pids[1])], check=True)
        deadline = time.monotonic() + 5
        while ranks.exited_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ranks.gone_before(time.monotonic()), "a rank gone before the death was seen: a kill"
        assert not ranks.gone_before(before), "a death seen before any rank went: a failed step"
    finally:
        ranks.close()
    ranks.close()  # twice: harmless (a rebuild closes, and so does the shutdown after it)


def test_an_engine_of_one_rank_has_none_to_watch():
    ranks = Ranks([2**22 + 12345])  # no such process
    assert ranks.pids == [] and not ranks.gone_before(time.monotonic())
    ranks.close()


def _executor(*alive: bool) -> SimpleNamespace:
    return SimpleNamespace(workers=[SimpleNamespace(proc=SimpleNamespace(is_alive=lambda a=a: a)) for a in alive])


@pytest.fixture
def leader():
    """A listening socket standing in for the leader's torch.distributed store."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _settings(port: int):
    return load_settings({}, nnodes=2, tensor_parallel_size=2, node_rank=1, master_port=port)


def test_a_follower_leaves_when_its_leaders_store_closes(leader):
    settings = _settings(leader.getsockname()[1])
    result: list[str] = []
    watching = threading.Thread(
        target=lambda: result.append(follower._serve(settings, _executor(True), threading.Event())))
    watching.start()
    conn, _ = leader.accept()
    time.sleep(0.3)
    assert watching.is_alive(), "the leader lives: the follower serves on"
    conn.close()
    leader.close()
    watching.join(5)
    assert result == ["leader_gone"]


def test_a_follower_leaves_when_one_of_its_ranks_dies_or_it_is_stopped(leader):
    settings = _settings(leader.getsockname()[1])
    assert follower._serve(settings, _executor(True, False), threading.Event()) == "rank_died"
    stop = threading.Event()
    stop.set()
    assert follower._serve(settings, _executor(True), stop) == "stopped"


def test_a_follower_with_no_leader_listening_leaves_at_once():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    assert follower._serve(_settings(port), _executor(True), threading.Event()) == "leader_gone"


@pytest.mark.parametrize("env", [{}, {"LLMQ_NNODES": "2", "LLMQ_TENSOR_PARALLEL_SIZE": "2"}])
def test_a_follower_of_no_multi_host_engine_refuses_to_start(env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        follower.main()
    assert exited.value.code == 2
