"""The status CLI (``llmq-status``) against a live queue: real Redis, the real API, a worker with a
scripted engine that holds its one slot, so some jobs run and some wait."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from shared.inspection import Consumer, read_queue
from shared.keys import GROUP, Keys
from shared.queue import JobStore
from shared.status import render, snapshot
from tests.conftest import REPO
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack

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


async def test_one_reading_of_a_queue_gives_every_levels_figures_in_one_round_trip(redis, keys):
    """shared.inspection.read_queue, which status, /metrics, the sweep and JobStore.depth all read:
    a level with entries and a group, one whose group no worker created yet, one never used."""
    model = "m"
    await redis.xgroup_create(keys.queue(model, 0), GROUP, id="0", mkstream=True)
    await redis.xadd(keys.queue(model, 0), {"job": "a"}, id="2000-0")
    await redis.xadd(keys.queue(model, 0), {"job": "b"}, id="3000-0")
    await redis.xreadgroup(GROUP, "w1", {keys.queue(model, 0): ">"}, count=1)  # "a" runs on w1
    await redis.xadd(keys.queue(model, 1), {"job": "c"}, id="1000-0")  # no group on this level yet
    await redis.xadd(keys.dead(model), {"job": "gone"})
    await redis.zadd(keys.workers(model), {"w1": 6000, "w0": 4000})  # w0's registration lapsed at 4000 ms

    plain = await read_queue(redis, keys, model, now_ms=5000)
    assert [(lv.level, lv.exists, lv.length, lv.pending, lv.waiting, lv.oldest_ms, lv.orphaned, lv.consumers)
            for lv in plain.levels] == [(0, True, 2, 1, 1, 2000, 0, ()), (1, True, 1, 0, 1, 1000, 0, ()),
                                        (2, False, 0, 0, 0, None, 0, ())]
    assert (plain.depth, plain.dead_letters, plain.ready_workers) == (3, 1, 1)
    assert await JobStore(redis, keys).depth(model) == 3

    swept = await read_queue(redis, keys, model, now_ms=5000, lease_ms=0)  # every delivered entry lapsed
    assert [(lv.orphaned, [(c.name, c.pending) for c in lv.consumers]) for lv in swept.levels] == [
        (1, [("w1", 1)]), (0, []), (0, [])]
    assert isinstance(swept.levels[0].consumers[0], Consumer) and swept.levels[0].oldest_orphan_ms >= 0
