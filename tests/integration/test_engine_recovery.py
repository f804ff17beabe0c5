"""A worker outlives its engine: rebuilt in place, its jobs continued one at a time, a killer
quarantined (workers/runner.py, the recovery), on real Redis with in-process workers.

The engine is ``ContextEngine`` (tests/support/scripted_engine.py), deterministic in its whole
context, so a continued job must equal one uninterrupted run. It dies two ways, as vLLM's does:
from outside (``die("killed")``: an OOM kill, an operator), and of its own step (a job marked
``kill-engine`` fails the step after its first token, as workers/faults.py makes real vLLM's do).
tests/e2e/test_engine_faults.py runs the same paths on real vLLM.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.events import Error
from tests.support import inprocess_workers
from tests.support.inprocess_workers import MODEL, Client, assert_seamless, running_on, wait_for
from tests.support.job_records import record
from tests.support.scripted_stack import scripted_stack

make_worker = inprocess_workers.make_worker

pytestmark = pytest.mark.faults


def since_restart(engine) -> list[tuple[str, str]]:
    """The engine's job starts and ends after its (last) rebuild, its warm-up left out."""
    after = max(i for i, (what, _) in enumerate(engine.log) if what == "restart")
    return [(what, job) for what, job in engine.log[after:]
            if what in ("start", "end") and not job.startswith("warmup-")]


async def test_an_engine_killed_under_several_jobs_is_rebuilt_in_place_and_each_continues_alone(make_worker, redis,
                                                                                                 keys):
    a = await make_worker(delay_s=0.02)
    engine = a.worker.engine
    clients = [Client(redis, a.queue) for _ in range(3)]
    prompts = [f"job {i} " for i in range(3)]
    ids = [await c.start(p, 60) for c, p in zip(clients, prompts, strict=True)]
    for job_id in ids:
        await running_on(a.queue, job_id, a.worker, min_tokens=3)
    engine.die("killed")
    await wait_for(lambda: asyncio.sleep(0, not a.worker._engine_up.is_set()))  # the worker saw it die
    # A job queued while the engine is down waits: nothing new until the suspects are done.
    late = Client(redis, a.queue)
    late_id = await late.start("late ", 10)
    for client, prompt in zip(clients, prompts, strict=True):
        assert_seamless(await client.finish(), prompt, 60)
    assert_seamless(await late.finish(), "late ", 10)

    assert engine.restarts == 1 and engine.deaths == ["killed"]
    assert not a.worker.failed and not a.task.done()
    order = since_restart(engine)
    # Each suspect alone, start to end; the late job only after all of them.
    assert sorted(job for what, job in order[:6:2]) == sorted(ids), order
    assert order[:6] == [(what, job) for _, job in order[:6:2] for what in ("start", "end")], order
    assert order[6:] == [("start", late_id), ("end", late_id)], order
    for job_id in ids:
        job = await a.queue.get_job(MODEL, job_id)
        # Same worker, same attempt: a rebuild is not a failed delivery, and no peer was involved.
        assert job.status == "done" and job.worker == a.worker.worker_id and job.attempt == 1
    assert await redis.xlen(keys.dead(MODEL)) == 0


async def test_a_job_alone_in_an_engine_whose_step_failed_is_dead_lettered_at_once(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    engine = a.worker.engine
    killer = Client(redis, a.queue)
    killer_id = await killer.start("killer ", 40, test_fault="kill-engine")
    events = await killer.finish()

    assert isinstance(events[-1], Error) and events[-1].code == "engine_fault" and events[-1].status == 424
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert engine.deaths == ["failed"], "one engine, never a second"
    job = await a.queue.get_job(MODEL, killer_id)
    assert job.status == "failed" and job.error.code == "engine_fault" and job.attempt == 1
    [(_, dead)] = await redis.xrange(keys.dead(MODEL))
    assert dead[b"job"].decode() == killer_id
    # The worker serves on, on its rebuilt engine.
    after = Client(redis, a.queue)
    await after.start("after ", 20)
    assert_seamless(await after.finish(), "after ", 20)
    assert engine.restarts == 1 and not a.worker.failed


async def test_a_killer_sharing_its_engine_dies_alone_the_second_time_and_takes_no_job_with_it(make_worker, redis,
                                                                                               keys):
    a = await make_worker(delay_s=0.02)
    engine = a.worker.engine
    others = [Client(redis, a.queue) for _ in range(2)]
    other_ids = [await c.start(f"other {i} ", 50) for i, c in enumerate(others)]
    for job_id in other_ids:
        await running_on(a.queue, job_id, a.worker, min_tokens=2)
    killer = Client(redis, a.queue)
    killer_id = await killer.start("killer ", 40, test_fault="kill-engine")
    events = await killer.finish(timeout=30)
    for i, client in enumerate(others):
        assert_seamless(await client.finish(timeout=30), f"other {i} ", 50)

    assert isinstance(events[-1], Error) and events[-1].code == "engine_fault"
    assert engine.deaths == ["failed", "failed"], "the shared step, then the killer alone: never a third"
    assert engine.restarts == 2 and not a.worker.failed
    [(_, dead)] = await redis.xrange(keys.dead(MODEL))
    assert dead[b"job"].decode() == killer_id
    for job_id in other_ids:
        job = await a.queue.get_job(MODEL, job_id)
        assert job.status == "done" and job.attempt == 1


async def test_a_job_alone_when_its_engine_is_killed_from_outside_is_continued_not_blamed(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("alone ", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    a.worker.engine.die("killed")
    assert_seamless(await client.finish(), "alone ", 60)
    assert (await a.queue.get_job(MODEL, job_id)).attempt == 1
    assert await redis.xlen(keys.dead(MODEL)) == 0


async def test_a_slow_rebuild_keeps_the_workers_leases_and_a_peer_takes_nothing(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)  # lease 1 s
    b = await make_worker(delay_s=0.02)
    a.worker.engine.restart_s = 3.0
    client = Client(redis, a.queue)
    job_id = await client.start("slow rebuild ", 40)
    await wait_for(lambda: asyncio.sleep(0, job_id in a.worker._running or job_id in b.worker._running))
    owner = a if job_id in a.worker._running else b
    owner.worker.engine.restart_s = 3.0
    await running_on(owner.queue, job_id, owner.worker, min_tokens=3)
    owner.worker.engine.die("killed")
    assert_seamless(await client.finish(timeout=30), "slow rebuild ", 40)
    job = await owner.queue.get_job(MODEL, job_id)
    assert job.worker == owner.worker.worker_id and job.attempt == 1, "three leases passed; nobody took it"


async def test_a_job_cancelled_while_its_engine_is_rebuilt_ends_cancelled(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    a.worker.engine.restart_s = 1.0
    client = Client(redis, a.queue)
    job_id = await client.start("cancel me ", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=3)
    a.worker.engine.die("killed")
    await wait_for(lambda: asyncio.sleep(0, job_id in a.worker._suspects))
    await a.queue.cancel(MODEL, job_id)
    events = await client.finish()
    assert isinstance(events[-1], Error) and events[-1].code == "cancelled"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert (await a.queue.get_job(MODEL, job_id)).status == "cancelled"


async def test_past_its_restarts_the_worker_exits_and_a_peer_continues_its_job(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02, engine_restarts=1)
    first = Client(redis, a.queue)
    first_id = await first.start("first ", 30)
    await running_on(a.queue, first_id, a.worker, min_tokens=3)
    a.worker.engine.die("killed")  # rebuilt: the first of one allowed
    assert_seamless(await first.finish(), "first ", 30)
    second = Client(redis, a.queue)
    second_id = await second.start("second ", 60)
    await running_on(a.queue, second_id, a.worker, min_tokens=3)
    b = await make_worker(delay_s=0.005)
    a.worker.engine.die("killed")  # one more within the window: the worker exits
    await asyncio.wait_for(a.task, 15)
    assert a.worker.failed and a.worker.engine.restarts == 1
    assert_seamless(await second.finish(timeout=30), "second ", 60)
    job = await b.queue.get_job(MODEL, second_id)
    assert job.worker == b.worker.worker_id and job.attempt == 2  # a peer's delivery: this one counts


async def test_an_engine_that_dies_idle_is_rebuilt_before_the_next_job(make_worker, redis, keys):
    a = await make_worker(delay_s=0.01)
    a.worker.engine.die("killed")
    await wait_for(lambda: asyncio.sleep(0, a.worker.engine.restarts == 1), timeout=10)  # seen by its heartbeat
    client = Client(redis, a.queue)
    await client.start("next ", 20)
    assert_seamless(await client.finish(), "next ", 20)
    assert await redis.xlen(keys.dead(MODEL)) == 0


# --- the marker, through the API ------------------------------------------------------------------

async def test_the_fault_marker_is_a_400_unless_fault_tests_are_on_and_a_body_never_sets_it(redis_url, prefix):
    async with scripted_stack(redis_url, prefix) as stack:  # LLMQ_TEST_FAULTS off: production's
        resp = await stack.client.post("/v1/completions", headers={"X-LLMQ-Test-Fault": "kill-engine"},
                                       json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-LLMQ-Test-Fault"
        assert "LLMQ_TEST_FAULTS" in resp.json()["error"]["message"]
        # /v1/jobs takes the internal request as its body: the field is dropped at admission.
        resp = await stack.client.post("/v1/jobs", json={"prompt": "hi", "sampling": {"max_tokens": 2},
                                                         "test_fault": "kill-engine"})
        assert resp.status_code in (200, 202), resp.text
        job = await record(stack.redis, stack.settings.prefix, resp.json()["id"])
        assert job.request.test_fault is None
        assert stack.worker.engine.deaths == []
    async with scripted_stack(redis_url, f"{prefix}-on", test_faults=True) as stack:
        resp = await stack.client.post("/v1/completions", headers={"X-LLMQ-Test-Fault": "kill-engine"},
                                       json={"prompt": "kill", "max_tokens": 20})
        assert resp.status_code == 424 and resp.json()["error"]["code"] == 424
        assert "Retry-After" not in resp.headers
        assert stack.worker.engine.deaths == ["failed"]
