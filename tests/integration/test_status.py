"""The status CLI (``llmq-status``) against a live queue: real Redis, the real API, a worker with a
scripted engine that holds its one slot, so some jobs run and some wait."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from shared.keys import Keys
from shared.status import render, snapshot
from tests.conftest import REPO
from tests.scripted_engine import ScriptedEngine
from tests.scripted_stack import scripted_stack

MODEL = "tiny"


async def test_status_shows_waiting_running_workers_and_dead_letters(redis_url, prefix):
    keys = Keys(prefix)
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.05), max_num_seqs=1,
                              heartbeat_s=0.2, drain_timeout_s=1) as s:
        ids = []
        for priority in (0, 0, 0, 5):
            resp = await s.client.post("/v1/jobs", json={"prompt": "hold", "priority": priority,
                                                         "sampling": {"max_tokens": 400}})
            assert resp.status_code in (200, 201, 202), resp.text
            ids.append(resp.json()["id"])
        # The operators' record of a dead-lettered job (what flush.lua writes when one dies).
        await s.redis.xadd(keys.dead(MODEL), {"job": "gone", "entry": "0-1", "attempts": "4", "at": "0"})
        while (await snapshot(s.redis, keys)).workers[0].running != 1:  # the next heartbeat says so
            await asyncio.sleep(0.05)

        status = await snapshot(s.redis, keys)
        [model] = status.models
        assert (model.name, model.waiting, model.running) == (MODEL, 3, 1)
        assert (model.dead_letters, model.ready_workers) == (1, 1)
        by_level = {lv.level: (lv.waiting, lv.running) for lv in model.levels}
        assert by_level == {0: (2, 1), 1: (0, 0), 2: (1, 0)}  # priority 5 waits on the lowest level
        ages = {lv.level: lv.oldest_age_s for lv in model.levels}
        assert ages[1] is None and 0 <= ages[2] <= ages[0] < 30  # the level-0 jobs were queued first
        [worker] = status.workers
        assert (worker.id, worker.model, worker.status, worker.slots, worker.running) == (
            s.worker.worker_id, MODEL, "ready", 1, 1)
        assert worker.last_heartbeat_age_s < 5

        text = render(status)
        assert f"model {MODEL}: 3 waiting, 1 running, 1 dead-lettered, 1 ready worker(s)" in text
        assert s.worker.worker_id in text

        # The command itself, as an operator runs it.
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "shared.status", "--url", redis_url, "--prefix", prefix, "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
        shown = json.loads(out.stdout)
        assert [(m["name"], m["waiting"], m["running"], m["dead_letters"]) for m in shown["models"]] == [
            (MODEL, 3, 1, 1)]
        assert [w["id"] for w in shown["workers"]] == [s.worker.worker_id]
        for job_id in ids:
            await s.client.delete(f"/v1/jobs/{job_id}")


async def test_status_of_an_empty_prefix_says_so(redis_url, prefix):
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "shared.status", "--url", redis_url, "--prefix", prefix],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert "no model has been served under this prefix" in out.stdout
    assert "workers: 0" in out.stdout
