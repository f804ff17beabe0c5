"""A worker in another network namespace joins the queue and serves jobs (deploy/netns-worker.sh).

The script puts ``python -m workers`` in a namespace of its own, reachable only through a veth
pair on a loopback-range /30 (127.77.x.y, unique per run); a dedicated redis-server listens on
127.0.0.1 (for the API and this test) and on the veth's host side (for the worker). The worker is
the only one on a fresh prefix, so every job it answers proves the path. Skipped where network
namespaces cannot be made (not root, no iproute2, an unprivileged container).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from shared.redis import redis_server_binary
from tests.conftest import REPO, free_port, wait_for_ping
from tests.support.event_log import ended_record
from tests.support.processes import spawn_logged
from tests.support.real_processes import spawn, stop_all, tail, wait_ready
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = REPO / "deploy" / "netns-worker.sh"
MAX_TOKENS = 32


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _require_netns(tag: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    probe = _ip("netns", "add", f"llmq-probe-{tag}")
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {probe.stderr.strip()}")
    _ip("netns", "del", f"llmq-probe-{tag}")


def _addresses() -> tuple[str, str]:
    """A /30 in 127.77.0.0/16 picked by pid, so concurrent runs (and the script's default,
    127.77.0.0/30) do not collide: .1 on the host side, .2 in the namespace."""
    third, fourth = divmod(4 * (1 + os.getpid() % 16383), 256)
    return f"127.77.{third}.{fourth + 1}", f"127.77.{third}.{fourth + 2}"


def _wait_for_address(dev: str, addr: str, script: subprocess.Popen, log: Path) -> None:
    def set_up() -> bool:
        if script.poll() is not None:
            pytest.fail(f"netns-worker.sh exited before it set up {dev}\n{tail(log)}")
        return f"inet {addr}/30" in _ip("-4", "-o", "addr", "show", "dev", dev).stdout
    eventually_sync(set_up, timeout_s=30, interval_s=0.1,
                    what=lambda: f"netns-worker.sh to set up {dev}\n{tail(log)}")


def test_a_worker_in_another_network_namespace_serves_the_queue(tmp_path):
    tag = f"t{os.getpid()}"
    _require_netns(tag)
    ns, host_if = f"llmq-{tag}", f"lqh-{tag}"
    host_addr, ns_addr = _addresses()
    model = load_settings({}).model_name
    keys, redis_port, api_port = Keys(f"netns-{uuid.uuid4().hex[:6]}"), free_port(), free_port()
    url = f"http://127.0.0.1:{api_port}"
    env = {**os.environ, "LLMQ_PREFIX": keys.prefix, "LLMQ_LOG_JSON": "true", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_DEVICE_LOCK_DIR": str(tmp_path / "locks")}
    worker_log, api_log, redis_log = tmp_path / "netns-worker.log", tmp_path / "api.log", tmp_path / "redis.log"
    script = spawn_logged(
        [str(SCRIPT)], worker_log, cwd=REPO, start_new_session=True,
        env={**env, "NETNS_TAG": tag, "NETNS_HOST_ADDR": host_addr, "NETNS_NS_ADDR": ns_addr,
             "LLMQ_REDIS_URL": f"redis://{host_addr}:{redis_port}/0"})
    procs = [(script, worker_log)]
    redis_proc = redis = None
    try:
        # Redis can bind the host-side address only once the script has made it; the worker
        # retries its first PING until then.
        _wait_for_address(host_if, host_addr, script, worker_log)
        redis_proc = spawn_logged(
            [redis_server_binary(), "--bind", "127.0.0.1", host_addr, "--port", str(redis_port), "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path)], redis_log)
        local_url = f"redis://127.0.0.1:{redis_port}/0"
        wait_for_ping(local_url)
        redis = Redis.from_url(local_url)
        api = spawn(["-m", "api"], {**env, "LLMQ_REDIS_URL": local_url, "LLMQ_PORT": str(api_port)}, api_log)
        procs.append((api, api_log))
        wait_ready(url, procs, 1)
        _serve_and_check(url, redis, keys, model, ns, ns_addr, worker_log)
    finally:
        stop_all(procs)  # SIGTERM: the script lets the worker drain, then removes namespace and veth
        if redis is not None:
            redis.close()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        leftovers = _ip("netns", "pids", ns).stdout.split()
        for pid in leftovers:  # only if the script itself died before its cleanup
            os.kill(int(pid), signal.SIGKILL)
        _ip("link", "del", host_if)
        _ip("netns", "del", ns)
    assert script.returncode == 0, tail(worker_log)
    assert not leftovers, f"processes left in {ns}: {leftovers}"
    assert ns not in _ip("netns", "list").stdout and _ip("link", "show", host_if).returncode != 0


def _serve_and_check(url: str, redis: Redis, keys: Keys, model: str, ns: str, ns_addr: str, log: Path) -> None:
    (worker,) = [w.decode() for w in redis.zrange(keys.workers(model), 0, -1)]
    pid = int(redis.hget(keys.worker(worker), "pid"))
    # The worker in the heartbeat is the process in the namespace, not one on the host's network.
    assert str(pid) in _ip("netns", "pids", ns).stdout.split(), (pid, tail(log))
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    # Its Redis connections come from the namespace's side of the veth.
    clients = redis.client_list()
    from_ns = [c for c in clients if c["addr"].rsplit(":", 1)[0] == ns_addr]
    assert from_ns, [c["addr"] for c in clients]

    results: dict[int, dict] = {}

    def complete(i: int) -> None:
        body = {"prompt": f"Namespace {i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            resp = client.post(f"{url}/v1/completions", json=body)
            results[i] = resp.json() if resp.status_code == 200 else {"status": resp.status_code, "body": resp.text}

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    for i in range(4):
        r = results.get(i, {})
        assert "choices" in r and r["usage"]["completion_tokens"] == MAX_TOKENS, (r, tail(log))
        record = ended_record(redis, keys, model, r["id"].removeprefix("cmpl-"))
        assert record[b"status"] == b"done" and record[b"worker"].decode() == worker, record
    print(f"worker {worker} (pid {pid}) in {ns}; its Redis connections: {[c['addr'] for c in from_ns]}")
