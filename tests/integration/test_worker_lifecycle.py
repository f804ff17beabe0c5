"""Worker lifecycle on real Redis with a scripted engine: drain on stop, heartbeat, cancellation.

The scripted engine makes timing controllable; the same loop runs on vLLM in tests/e2e.
"""

from __future__ import annotations

import asyncio
import gc
import json
import uuid

import msgspec
import pytest
import structlog

from shared.config import load_settings
from shared.errors import JobCancelled
from shared.keys import GROUP, Keys
from shared.queue import Consumer, JobStore, now_ms
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from shared.slo import Rates
from shared.status import snapshot
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.waiting import eventually
from workers.runner import Worker


@pytest.fixture
async def make_worker(redis, prefix):
    started: list[tuple[Worker, asyncio.Task]] = []

    async def start(delay_s: float = 0.001, engine: ScriptedEngine | None = None,
                    **settings_overrides) -> tuple[Worker, JobStore]:
        settings = load_settings({}, prefix=prefix, served_model_name="m", **{"block_ms": 100, "heartbeat_s": 0.2,
                                                                              **settings_overrides})
        queue = JobStore(redis, Keys(prefix))
        worker = Worker(settings, Consumer(redis, Keys(prefix)), engine or ScriptedEngine(delay_s=delay_s))
        task = asyncio.create_task(worker.run())
        started.append((worker, task))
        while not worker.ready:
            await asyncio.sleep(0.01)
        return worker, queue

    yield start
    for worker, task in started:
        worker.stop()
        await asyncio.wait_for(task, 10)


async def _submit(queue: JobStore, prompt: str, max_tokens: int) -> str:
    rec = JobRecord(id=uuid.uuid4().hex, model="m", queued_at=now_ms(),
                    request=GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens)))
    return await queue.enqueue(rec)


async def _wait_status(queue: JobStore, job_id: str, *statuses: str, timeout: float = 10) -> str:
    async def status() -> str | None:
        job = await queue.get_job("m", job_id)
        return job.status if job is not None and job.status in statuses else None
    return await eventually(status, timeout_s=timeout, interval_s=0.01, what=f"job {job_id} to be {statuses}")


async def test_stop_drains_in_flight_jobs_then_unregisters(make_worker, redis, keys):
    worker, queue = await make_worker(delay_s=0.01)
    # Ready: in the model's ready set (the API's health checks), until three heartbeats (0.2 s) on.
    expiry = await redis.zscore(keys.workers("m"), worker.worker_id)
    assert expiry is not None and now_ms() < expiry <= now_ms() + 3 * 0.2 * 1000
    job_id = await _submit(queue, "drain", 50)  # ~0.5 s of tokens
    await _wait_status(queue, job_id, "running")
    worker.stop()
    await _wait_status(queue, job_id, "done")
    job = await queue.get_job("m", job_id)
    assert job.result.choices[0].text == expected_text("drain", 50)
    async with asyncio.timeout(5):
        while await redis.exists(keys.worker(worker.worker_id)):
            await asyncio.sleep(0.05)
    assert await redis.zscore(keys.workers("m"), worker.worker_id) is None


@pytest.mark.parametrize("hands_from_loop", [False, True], ids=["from-the-job", "from-the-engine-loop"])
async def test_each_jobs_finished_line_names_that_job_whichever_task_hands_its_steps_over(make_worker,
                                                                                         hands_from_loop):
    """The real engine hands steps over from its own loop (workers/engine_loop.py), not from the
    job's task: the job's lines still carry its job_id and attempt (bound in the job's task), and
    never another job's."""
    worker, queue = await make_worker(engine=ScriptedEngine(0.002, hands_from_loop=hands_from_loop))
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        ids = [await _submit(queue, f"job{i}", 8) for i in range(3)]
        for job_id in ids:
            await _wait_status(queue, job_id, "done")
    finished = [e for e in logs if e["event"] == "job_finished"]
    assert sorted(e.get("job_id", "") for e in finished) == sorted(ids)
    assert all(e.get("attempt") == 1 and e.get("worker") == worker.worker_id for e in finished)


async def test_heartbeat_reports_slots_and_running(make_worker, redis, keys):
    worker, queue = await make_worker(delay_s=0.02)
    job_id = await _submit(queue, "beat", 100)
    await _wait_status(queue, job_id, "running")
    await asyncio.sleep(0.5)
    beat = await redis.hgetall(keys.worker(worker.worker_id))
    assert beat[b"model"] == b"m" and beat[b"slots"] == b"64" and beat[b"status"] == b"ready"
    assert beat[b"max_model_len"] == b"2048"  # what the API advertises as the context (api/models.py)
    assert beat[b"running"] == b"1"
    assert 0 < await redis.ttl(keys.worker(worker.worker_id)) <= 2


async def test_heartbeat_reports_the_rates_measured_on_its_jobs(make_worker, redis, keys):
    """After a job ran: its prefill, the tokens per second while it ran, and its tokens, in the
    heartbeat as JSON, and in the status read from it (what SLO-aware admission reads)."""
    worker, queue = await make_worker(delay_s=0.005)
    first = await eventually(lambda: redis.hget(keys.worker(worker.worker_id), "rates"), timeout_s=5,
                             interval_s=0.05, what="the first heartbeat")
    assert msgspec.json.decode(first, type=Rates) == Rates()  # the warm-up is no job's
    await _wait_status(queue, await _submit(queue, "rated", 20), "done")

    async def rates() -> Rates | None:
        beat = await redis.hgetall(keys.worker(worker.worker_id))
        measured = msgspec.json.decode(beat[b"rates"], type=Rates)
        return measured if measured.generated_per_job else None

    measured = await eventually(rates, timeout_s=5, interval_s=0.05, what="a heartbeat with the job's rates")
    assert measured.prefill_tps > 0 and measured.decode_tps > 0 and measured.generated_per_job == 20.0
    [shown] = [w for w in (await snapshot(redis, keys, top=0, held=False)).workers if w.id == worker.worker_id]
    assert shown.rates.generated_per_job == 20.0 and shown.rates.decode_tps > 0


async def test_worker_never_holds_more_jobs_than_slots(make_worker, redis, keys):
    worker, queue = await make_worker(delay_s=0.02, max_num_seqs=3)
    ids = [await _submit(queue, f"s{i}", 20) for i in range(9)]
    async with asyncio.timeout(20):
        while True:
            statuses = [(await queue.get_job("m", i)).status for i in ids]
            if all(s == "done" for s in statuses):
                break
            await asyncio.sleep(0.005)
    # The engine never runs more jobs than its slots (the pending list may briefly also hold a
    # finished job whose ack is in the next flush), and it did run them side by side.
    assert worker.engine.peak_active == 3
    assert (await redis.xpending(keys.queue("m"), GROUP))["pending"] == 0


async def test_cancel_reaches_the_worker_that_runs_the_job(make_worker):
    worker, queue = await make_worker(delay_s=0.01)
    job_id = await _submit(queue, "stop", 1000)
    await _wait_status(queue, job_id, "running")
    assert await queue.cancel("m", job_id) == "running"
    assert await _wait_status(queue, job_id, "cancelled") == "cancelled"
    assert job_id in worker.engine.aborted


async def test_a_request_no_worker_can_decode_fails_that_job_not_the_worker(make_worker, redis, keys):
    worker, queue = await make_worker()
    # Structs do not validate on construction: this is what a buggy (or newer) API could queue.
    bad = JobRecord(id=uuid.uuid4().hex, model="m", queued_at=now_ms(),
                    request=GenerationRequest(prompt="x", sampling=SamplingParams(temperature=5.0)))
    await queue.enqueue(bad)
    async with asyncio.timeout(10):  # read raw: the record's request does not decode either
        while await redis.hget(keys.job("m", bad.id), "status") != b"failed":
            await asyncio.sleep(0.01)
    error = json.loads(await redis.hget(keys.job("m", bad.id), "error"))
    assert error["code"] == "invalid_request" and error["status"] == 400
    good = await _submit(queue, "still here", 3)  # the worker kept running
    assert await _wait_status(queue, good, "done") == "done"


async def test_stop_ends_a_blocked_read_at_once(make_worker, redis, keys):
    """An idle worker waits in XREADGROUP for up to LLMQ_BLOCK_MS; SIGTERM must not wait that out
    before the drain (a job on the engine would run on past its drain window meanwhile)."""
    worker, queue = await make_worker(block_ms=30_000)
    await asyncio.sleep(0.3)  # the reader is blocked in its 30 s read by now
    stopped = asyncio.get_running_loop().time()
    worker.stop()
    async with asyncio.timeout(10):
        while await redis.exists(keys.worker(worker.worker_id)):  # unregistered: run() has returned
            await asyncio.sleep(0.02)
    assert asyncio.get_running_loop().time() - stopped < 2.0
    job_id = await _submit(queue, "after", 3)  # delivered to nobody: the stopped reader took nothing
    await asyncio.sleep(0.2)
    assert (await redis.xpending(keys.queue("m"), GROUP))["pending"] == 0
    assert (await queue.get_job("m", job_id)).status == "queued"


async def test_a_cancel_that_arrives_before_its_job_task_starts_still_ends_the_job(redis, prefix):
    """A DELETE just as the job is picked: the cancel notice reaches the worker after the claim
    and before the job's task has run a step (a task cancelled then never runs its coroutine).
    The job still ends as cancelled, its slot is free and its queue entry is gone."""
    keys = Keys(prefix)
    settings = load_settings({}, prefix=prefix, served_model_name="m")
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group("m")
    worker = Worker(settings, consumer, ScriptedEngine(delay_s=0.01), worker_id="w-unstarted")
    record = JobRecord(id=uuid.uuid4().hex, model="m", queued_at=now_ms(),
                       request=GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens=50)))
    await store.enqueue(record)
    [delivery] = (await consumer.pick("m", worker.worker_id, 1)).deliveries
    async with asyncio.TaskGroup() as worker._tasks:  # the run's task group, where job tasks start
        with worker.slots.reserve(1) as slots:
            await worker._accept(delivery, slots)
        assert worker.cancel_job(record.id, JobCancelled("job was cancelled"))  # before the task's first step
        for _ in range(3):
            await asyncio.sleep(0)
    assert record.id not in worker._running and worker.slots.available == worker.slots.total
    await worker.outbox.flush()
    stored = await store.get_job("m", record.id)
    assert stored.status == "cancelled" and stored.error.code == "cancelled"
    assert await redis.xlen(keys.queue("m")) == 0
    assert (await redis.xpending(keys.queue("m"), GROUP))["pending"] == 0


async def test_a_worker_that_owns_its_heap_freezes_it_after_warm_up_and_serves_on(redis, prefix):
    """LLMQ_GC_FREEZE: what the worker holds once warm is out of the cyclic GC's reach (as `vllm
    serve` freezes its heap after start-up); jobs allocated after it still run and end."""
    gc.unfreeze()
    settings = load_settings({}, prefix=prefix, served_model_name="m", block_ms=100, heartbeat_s=0.2)
    worker = Worker(settings, Consumer(redis, Keys(prefix)), ScriptedEngine(delay_s=0.001), freeze_heap=True)
    task = asyncio.create_task(worker.run())
    try:
        await eventually(lambda: worker.ready, timeout_s=10, what="the worker to warm up")
        assert gc.get_freeze_count() > 0
        queue = JobStore(redis, Keys(prefix))
        job_id = await _submit(queue, "after the freeze", 4)
        assert await _wait_status(queue, job_id, "done") == "done"
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        gc.unfreeze()  # the test process's heap is pytest's, not the worker's


async def test_a_worker_in_a_shared_process_leaves_the_heap_alone(make_worker):
    gc.unfreeze()
    await make_worker()
    assert gc.get_freeze_count() == 0
