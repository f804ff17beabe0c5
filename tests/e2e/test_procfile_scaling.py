"""``honcho start -c worker=2`` with the repo's real Procfile: both workers claim a slot and serve.

One honcho formation (web, housekeeping and two workers) on a fresh prefix and a private device
lock directory. Each worker claims a CPU slot by itself (workers/claim.py); on this 2-core box
there is one CPU share, so both run on it unpinned, as a lone worker would, in different slots.
Eight greedy completions at once against 2 engine slots per worker: no single worker can hold
them all, so both must take some. Every request must come back whole.
"""

from __future__ import annotations

import os
import threading
import uuid

import httpx
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.conftest import free_port
from tests.support.event_log import ended_record
from tests.support.procfile import BIN, kill_leftovers, start_honcho
from tests.support.real_processes import stop_all, tail, wait_ready
from workers.claim import claim_cpu_share

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SLOTS = 2
REQUESTS = 8
MAX_TOKENS = 48


def test_honcho_scales_procfile_workers_that_claim_distinct_slots_and_share_the_queue(redis_url, tmp_path):
    model = load_settings({}).model_name
    keys, port = Keys(f"scale-{uuid.uuid4().hex[:6]}"), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": keys.prefix, "LLMQ_PORT": str(port),
           "LLMQ_MAX_NUM_SEQS": str(SLOTS), "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_LOG_JSON": "true", "LLMQ_DEVICE_LOCK_DIR": str(tmp_path / "locks")}
    log = tmp_path / "honcho.log"
    honcho = start_honcho(["-c", "worker=2"], env, log)
    procs = [(honcho, log)]
    redis = Redis.from_url(redis_url)
    try:
        wait_ready(url, procs, 2)
        workers = [w.decode() for w in redis.zrange(keys.workers(model), 0, -1)]
        devices = {w: (redis.hget(keys.worker(w), "device") or b"").decode() for w in workers}

        results: dict[int, dict] = {}

        def complete(i: int) -> None:
            body = {"prompt": f"Request number {i} says", "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            with httpx.Client(timeout=180) as client:
                resp = client.post(f"{url}/v1/completions", json=body)
                results[i] = resp.json() if resp.status_code == 200 else {"status": resp.status_code, "body": resp.text}

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
        served_by = {}
        for i in range(REQUESTS):
            r = results.get(i, {})
            assert "choices" in r, (i, r, tail(log))
            assert r["choices"][0]["finish_reason"] == "length", r
            assert r["usage"]["completion_tokens"] == MAX_TOKENS, r
            job_id = r["id"].removeprefix("cmpl-")
            # The answer's last byte can come a moment before the record says the job ended.
            record = ended_record(redis, keys, model, job_id)
            assert record.get(b"status") == b"done", (job_id, record.get(b"status"))
            served_by[job_id] = record[b"worker"].decode()
        print(f"devices: {devices}; jobs per worker: "
              f"{ {w: list(served_by.values()).count(w) for w in workers} }")

        assert len(workers) == 2, workers
        assert set(served_by.values()) == set(workers), f"not every worker took jobs: {served_by}"
        assert all(d.startswith("cpu:") for d in devices.values()), devices
        slots = {d.split()[0] for d in devices.values()}
        assert slots == {"cpu:0", "cpu:1"}, f"the workers did not claim distinct slots: {devices}"
        # A lock per slot, and the host's claim lock that makes a claim of several devices atomic.
        assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["claim.lock", "cpu-0.lock", "cpu-1.lock"]
    finally:
        stop_all(procs)
        kill_leftovers([log])
        redis.close()
    # The workers are gone, and so are their claims.
    again = claim_cpu_share(tmp_path / "locks", [[0]])
    again.release()
    assert again.label.startswith("cpu:0 "), again.label
