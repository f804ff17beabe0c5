"""Device claims (workers/claim.py): per-device flock files in a temp dir, fake device counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import SettingsError, load_settings
from tests.conftest import REPO
from workers import claim as claims
from workers.claim import NoFreeDevice, claim_cpu_share, claim_device, claim_gpus, split_cpus
from workers.environment import apply_device_environment, visible_gpus

HOLD = """
import sys, time
from pathlib import Path
from workers.claim import claim_gpus
c = claim_gpus(Path(sys.argv[1]), ["0", "1"])
print(c.label, flush=True)
time.sleep(600)
"""


@pytest.fixture
def release():
    held = []
    yield held.append
    for c in held:
        c.release()


def test_two_claims_take_different_gpus_and_a_third_fails_naming_the_holders(tmp_path, release):
    first, second = claim_gpus(tmp_path, ["0", "1"]), claim_gpus(tmp_path, ["0", "1"])
    release(first), release(second)
    assert (first.label, first.cuda_visible_devices) == ("gpu:0", "0")
    assert (second.label, second.cuda_visible_devices) == ("gpu:1", "1")
    with pytest.raises(NoFreeDevice, match=rf"0 \(pid {os.getpid()}\), 1 \(pid {os.getpid()}\)"):
        claim_gpus(tmp_path, ["0", "1"])
    first.release()
    again = claim_gpus(tmp_path, ["0", "1"])
    release(again)
    assert again.label == "gpu:0"


def test_a_claim_held_by_a_sigkilled_process_is_free_again(tmp_path, release):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "gpu:0"
        mine = claim_gpus(tmp_path, ["0", "1"])
        release(mine)
        assert mine.label == "gpu:1"
        with pytest.raises(NoFreeDevice, match=rf"0 \(pid {holder.pid}\)"):
            claim_gpus(tmp_path, ["0", "1"])
    finally:
        holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the flock with the process
        holder.wait(10)
        holder.stdout.close()
    freed = claim_gpus(tmp_path, ["0", "1"])
    release(freed)
    assert freed.label == "gpu:0"


def test_a_tensor_parallel_claim_takes_that_many_free_gpus_or_none(tmp_path, release):
    release(claim_gpus(tmp_path, ["0", "1", "2", "3"]))
    pair = claim_gpus(tmp_path, ["0", "1", "2", "3"], count=2)
    release(pair)
    assert pair.cuda_visible_devices == "1,2"
    with pytest.raises(NoFreeDevice):
        claim_gpus(tmp_path, ["0", "1", "2", "3"], count=2)
    last = claim_gpus(tmp_path, ["0", "1", "2", "3"])  # the failed pair gave GPU 3 back
    release(last)
    assert last.label == "gpu:3"


def test_gpus_are_counted_on_the_host_without_cuda_visible_devices(tmp_path, monkeypatch, release):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(claims, "gpu_count", lambda: 2)
    settings = load_settings({}, device_lock_dir=str(tmp_path))
    got = [claim_device(settings, os.environ, on_cpu=False) for _ in range(2)]
    for c in got:
        release(c)
    assert [c.label for c in got] == ["gpu:0", "gpu:1"]
    with pytest.raises(NoFreeDevice, match="no 1 free GPU"):
        claim_device(settings, os.environ, on_cpu=False)


def test_an_operator_set_cuda_visible_devices_is_the_pool(tmp_path, monkeypatch, release):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    monkeypatch.setattr(claims, "gpu_count", lambda: pytest.fail("counted GPUs despite CUDA_VISIBLE_DEVICES"))
    settings = load_settings({}, device_lock_dir=str(tmp_path))
    got = [claim_device(settings, os.environ, on_cpu=False) for _ in range(2)]
    for c in got:
        release(c)
    assert [c.cuda_visible_devices for c in got] == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == [] and visible_gpus({}) is None


def test_llmq_devices_pins_exactly_those_gpus_even_when_claimed(tmp_path, monkeypatch, release):
    monkeypatch.setattr(claims, "gpu_count", lambda: 4)
    release(claim_gpus(tmp_path, ["0"]))
    settings = load_settings({"LLMQ_DEVICES": "0,1", "LLMQ_DEVICE_LOCK_DIR": str(tmp_path),
                              "LLMQ_TENSOR_PARALLEL_SIZE": "2"})
    pinned = claim_device(settings, os.environ, on_cpu=False)
    release(pinned)
    assert (pinned.label, pinned.cuda_visible_devices) == ("gpu:0,1", "0,1")
    # GPU 1 is now locked by the pinned worker, so a claiming worker skips it.
    auto = claim_device(load_settings({}, device_lock_dir=str(tmp_path)), os.environ, on_cpu=False)
    release(auto)
    assert auto.label == "gpu:2"


def test_a_host_with_no_visible_gpu_leaves_the_choice_to_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    c = claim_device(load_settings({}, device_lock_dir=str(tmp_path)), os.environ, on_cpu=False)
    assert (c.label, c.fds, c.cuda_visible_devices) == ("gpu:unclaimed", [], None)


def test_the_claimed_gpus_reach_the_engine_environment():
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    apply_device_environment("2", None, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    apply_device_environment(None, None, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}


def test_cpus_split_into_contiguous_shares():
    assert split_cpus(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cpus([0, 1, 2], 2) == [[0, 1], [2]]
    assert split_cpus([0, 1], 5) == [[0], [1]]
    nodes = split_cpus([0, 1], 0)  # one per NUMA node this process may use (one here, or none known)
    assert sorted(c for share in nodes for c in share) == [0, 1]


def test_one_cpu_share_never_pins_and_never_refuses_a_worker(tmp_path, release):
    got = [claim_cpu_share(tmp_path, [[0, 1]]) for _ in range(3)]
    for c in got:
        release(c)
    assert [c.label for c in got] == ["cpu:0 cpus=0-1", "cpu:1 cpus=0-1", "cpu:2 cpus=0-1"]
    assert all(c.cpus is None and c.cuda_visible_devices is None for c in got)
    affinity = os.sched_getaffinity(0)
    got[0].apply(os.environ)  # no pinning: a lone worker runs exactly as before claims existed
    assert os.sched_getaffinity(0) == affinity


def test_cpu_shares_go_to_workers_in_turn_and_wrap_when_oversubscribed(tmp_path, release):
    shares = split_cpus(list(range(8)), 2)
    got = [claim_cpu_share(tmp_path, shares) for _ in range(3)]
    for c in got:
        release(c)
    assert [c.cpus for c in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert got[1].label == "cpu:1 cpus=4-7"
    got[0].release()
    reuse = claim_cpu_share(tmp_path, shares)  # the lowest free slot first
    release(reuse)
    assert reuse.label == "cpu:0 cpus=0-3"


def test_lock_files_name_their_holder(tmp_path, release):
    c = claim_gpus(tmp_path, ["7"])
    release(c)
    assert Path(tmp_path / "gpu-7.lock").read_text() == f"{os.getpid()}\n"


async def test_a_worker_with_no_free_gpu_exits_non_zero_before_loading_anything(tmp_path, monkeypatch):
    import workers.__main__ as entry

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(claims, "cpu_engine", lambda: False)
    monkeypatch.setattr(claims, "apply_engine_environment", lambda s, env: pytest.fail("got past the claim"))
    busy = claim_gpus(tmp_path, ["0"])
    try:
        with pytest.raises(SystemExit) as exited:
            await entry.serve(load_settings({}, device_lock_dir=str(tmp_path)))
    finally:
        busy.release()
    assert exited.value.code == 1


def test_a_worker_of_two_ranks_claims_two_gpus_of_its_pool(tmp_path, monkeypatch, release):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    settings = load_settings({}, device_lock_dir=str(tmp_path), tensor_parallel_size=2)
    pair = claim_device(settings, os.environ, on_cpu=False)
    release(pair)
    assert (pair.label, pair.cuda_visible_devices, pair.devices) == ("gpu:4,5", "4,5", ["gpu:4", "gpu:5"])
    with pytest.raises(NoFreeDevice, match="no 2 free GPU"):  # one is left: all or none
        claim_device(settings, os.environ, on_cpu=False)
    assert claim_gpus(tmp_path, ["4", "5", "6"]).label == "gpu:6", "the refused claim kept nothing"


def test_a_multi_host_engine_claims_this_hosts_share_of_its_ranks(tmp_path, monkeypatch, release):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    settings = load_settings({}, device_lock_dir=str(tmp_path), tensor_parallel_size=8, pipeline_parallel_size=2,
                             nnodes=2)
    mine = claim_device(settings, os.environ, on_cpu=False)
    release(mine)
    assert mine.cuda_visible_devices == "0,1,2,3,4,5,6,7"


def test_claims_of_several_devices_wait_for_each_other(tmp_path):
    """The host's claim lock: while one process claims, another's claim waits for it."""
    script = ("import sys; from pathlib import Path; from workers.claim import claim_gpus; "
              "print(claim_gpus(Path(sys.argv[1]), ['0', '1'], count=2).label, flush=True)")
    with claims._claiming(tmp_path):
        other = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                                 text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(1.5)
    assert other.communicate(timeout=60)[0].strip() == "gpu:0,1"


@pytest.mark.parametrize(("env", "problem"), [
    ({"LLMQ_TENSOR_PARALLEL_SIZE": "2", "LLMQ_DEVICES": "0"},
     "LLMQ_DEVICES='0' names 1 GPU(s), but this host's share of the engine"),
    ({"LLMQ_TENSOR_PARALLEL_SIZE": "2", "LLMQ_DEVICES": "0,1,2"}, "names 3 GPU(s)"),
    ({"LLMQ_TENSOR_PARALLEL_SIZE": "3", "LLMQ_NNODES": "2"}, "3 ranks do not divide over LLMQ_NNODES=2"),
    ({"LLMQ_NNODES": "2", "LLMQ_TENSOR_PARALLEL_SIZE": "2", "LLMQ_NODE_RANK": "2"},
     "LLMQ_NODE_RANK=2 is not below LLMQ_NNODES=2"),
    ({"LLMQ_NNODES": "2", "LLMQ_TENSOR_PARALLEL_SIZE": "2", "LLMQ_DISTRIBUTED_EXECUTOR_BACKEND": "ray"},
     "LLMQ_NNODES is for the mp backend"),
    ({"LLMQ_TENSOR_PARALLEL_SIZE": "0"}, "tensor_parallel_size"),
    ({"LLMQ_DISTRIBUTED_EXECUTOR_BACKEND": "ray", "LLMQ_DEVICES": "0"}, "the Ray cluster places every rank"),
])
def test_a_layout_that_cannot_be_built_is_refused_at_start_naming_the_settings(env, problem):
    with pytest.raises(SettingsError, match="invalid llmq settings") as refused:
        load_settings(env)
    assert problem in str(refused.value)


def test_layouts_that_can_be_built_load():
    s = load_settings({"LLMQ_TENSOR_PARALLEL_SIZE": "4", "LLMQ_PIPELINE_PARALLEL_SIZE": "2", "LLMQ_NNODES": "2",
                       "LLMQ_DEVICES": "0,1,2,3"})
    assert (s.world_size, s.local_ranks, s.executor_backend) == (8, 4, "mp")
    one = load_settings({})
    assert (one.world_size, one.local_ranks, one.executor_backend) == (1, 1, None)


def test_a_cpu_engine_of_two_ranks_binds_each_rank_to_its_own_cpus(tmp_path, release, monkeypatch):
    """A 2-CPU host, one NUMA node: two ranks get a CPU each (vLLM's VLLM_CPU_OMP_THREADS_BIND),
    and a worker of one rank started beside them shares a CPU, warned."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(claims, "split_cpus", lambda usable, shares: [[0, 1]] if shares <= 1 else [[0], [1]])
    tp2 = claim_device(load_settings({}, device_lock_dir=str(tmp_path), tensor_parallel_size=2), {}, on_cpu=True)
    release(tp2)
    assert (tp2.label, tp2.omp_bind, tp2.cpus, tp2.devices) == ("cpu:0,1 cpus=0|1", "0|1", None, ["cpu:0", "cpu:1"])
    env: dict[str, str] = {}
    tp2.apply(env)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    tp1 = claim_device(load_settings({}, device_lock_dir=str(tmp_path)), {}, on_cpu=True)
    release(tp1)
    assert (tp1.label, tp1.omp_bind, tp1.cpus) == ("cpu:2 cpus=0-1", None, None), "oversubscribed, not refused"


def test_a_cpu_engine_of_two_ranks_on_two_numa_nodes_gets_one_node_per_rank(tmp_path, release):
    tp2 = claim_cpu_share(tmp_path, [[0, 1, 2, 3], [4, 5, 6, 7]], ranks=2)
    release(tp2)
    assert (tp2.omp_bind, tp2.cpus) == ("0-3|4-7", None)
    again = claim_cpu_share(tmp_path, [[0, 1, 2, 3], [4, 5, 6, 7]], ranks=1)
    release(again)
    assert again.cpus == [0, 1, 2, 3]  # slot 2 wraps to share 0


def test_a_pipeline_parallel_cpu_engine_compiles_unless_told_otherwise(monkeypatch):
    from workers import environment

    monkeypatch.setattr(environment, "cpu_engine", lambda: True)
    assert environment.eager(load_settings({})) is True
    assert environment.eager(load_settings({}, pipeline_parallel_size=2)) is False
    assert environment.eager(load_settings({}, pipeline_parallel_size=2, enforce_eager=True)) is True


def test_a_ray_engine_claims_no_device_of_its_own(tmp_path, monkeypatch):
    """Sixteen ranks over two 8-GPU hosts: Ray places them all; a claim of 16 here would fail."""
    monkeypatch.setattr(claims, "gpu_count", lambda: 8)
    settings = load_settings({}, device_lock_dir=str(tmp_path), tensor_parallel_size=8, pipeline_parallel_size=2,
                             distributed_executor_backend="ray")
    claim = claim_device(settings, {}, on_cpu=False)
    assert (claim.label, claim.fds, claim.cuda_visible_devices) == ("ray", [], None)


@pytest.mark.parametrize(("module", "code"), [("workers", 1), ("workers.follower", 1), ("workers.housekeeping", 1),
                                              ("api", 3)])
def test_every_process_refuses_a_layout_it_cannot_build_in_one_line(module, code):
    """No traceback: one line naming the settings, and the exit code its supervisor reads (the web
    process's is uvicorn's "never started", which a restart cannot mend)."""
    env = {**os.environ, "LLMQ_TENSOR_PARALLEL_SIZE": "2", "LLMQ_DEVICES": "0"}
    done = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == code
    assert done.stderr.splitlines() == [
        "llmq: invalid llmq settings: LLMQ_DEVICES='0' names 1 GPU(s), but this host's share of the engine "
        "(LLMQ_TENSOR_PARALLEL_SIZE × LLMQ_PIPELINE_PARALLEL_SIZE = 2 over LLMQ_NNODES=1) is 2"]
