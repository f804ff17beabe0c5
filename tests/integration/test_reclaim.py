"""Leases, reclaim, fencing, dead letter and drain hand-back on real Redis with in-process workers.

The engine here (``tests.support.scripted_engine.ContextEngine``) is deterministic in its whole context
(each next token is a function of every token before it, like greedy decoding), so a job
continued from "prompt + published tokens" must produce exactly what an uninterrupted run
produces. The client side is the real relay (``api.follow.follow`` over a live pub/sub
subscription, ``tests.support.inprocess_workers.Client``), as an API process would run it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import load_settings
from shared.errors import WorkerLost
from shared.events import Error, TokenDelta, Tokens
from shared.keys import GROUP
from shared.queue import Consumer, JobStore, Outbound
from shared.schemas import GenerationRequest, SamplingParams, StructuredOutput
from tests.support import inprocess_workers
from tests.support.inprocess_workers import MODEL, Client, assert_seamless, kill, running_on, submit, wait_for
from tests.support.scripted_engine import expected_ids
from workers.continuation import plan_continuation

make_worker = inprocess_workers.make_worker  # in-process workers with a ContextEngine, on real Redis


@pytest.mark.faults
async def test_a_dead_workers_job_continues_on_a_live_worker_seamlessly(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("crash me", 120)
    await running_on(a.queue, job_id, a.worker, min_tokens=10)
    b = await make_worker(delay_s=0.005)
    await kill(a)
    killed_at = time.monotonic()
    events = await client.finish()
    recovered_s = time.monotonic() - killed_at

    assert_seamless(events, "crash me", 120)
    job = await b.queue.get_job(MODEL, job_id)
    assert job.status == "done" and job.worker == b.worker.worker_id and job.attempt == 2
    assert [c.token_ids for c in job.result.choices] == [expected_ids("crash me", 120)]
    # B continued with prompt + published tokens and the rest of the budget, not from scratch.
    continued = b.worker.engine.requests[-1]  # [0] is the warm-up
    published = len(continued.prompt_token_ids) - len("crash me")
    assert 10 <= published < 120 and continued.sampling.max_tokens == 120 - published
    assert await redis.xlen(keys.queue(MODEL)) == 0
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0
    assert recovered_s < 10  # lease 1 s; the measured figure is in the report
    print(f"recovered in {recovered_s:.2f} s (lease 1 s)")


async def test_a_stalled_worker_loses_its_job_and_its_late_writes_are_refused(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("stall", 150)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    attempt = (await a.queue.get_job(MODEL, job_id)).attempt

    async def no_renewal(*args, **kwargs) -> list[str]:
        return []  # A's heartbeat misses every renewal (a blocked loop) while its engine keeps going

    a.worker.queue.renew = no_renewal
    # A blocked loop does not reclaim either: A's own XAUTOCLAIM would otherwise renew its job.
    a.worker.queue.reclaim = no_renewal
    b = await make_worker(delay_s=0.005)
    events = await client.finish()

    assert_seamless(events, "stall", 150)
    job = await b.queue.get_job(MODEL, job_id)
    assert job.worker == b.worker.worker_id and job.attempt == attempt + 1
    # A learnt it lost the job from its first refused write, aborted it, and wrote nothing more.
    await wait_for(lambda: asyncio.sleep(0, job_id in a.worker.engine.aborted))
    assert job_id not in a.worker._running
    # A write with A's old (worker, attempt) is refused outright: nothing reaches channel or log.
    logged = await a.queue.read_events(MODEL, job_id)
    stale = Tokens(seq=len(logged) + 1, deltas=[TokenDelta(token_ids=[1], text="x")])
    assert (await a.worker.queue.flush(MODEL, [Outbound.of(job_id, stale, attempt=attempt)],
                                a.worker.worker_id)).lost == [job_id]
    assert await a.queue.read_events(MODEL, job_id) == logged


async def test_jobs_go_to_the_dead_letter_stream_after_n_failed_deliveries(make_worker, redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    job_id = await submit(store, "poison", 50)
    # Two deliveries to consumers that die without a word (max_deliveries=2 below).
    [first] = (await consumer.pick(MODEL, "ghost-1", 1, max_deliveries=2)).deliveries
    await consumer.flush(MODEL, [Outbound.of(job_id, Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
                                             attempt=first.attempt)], "ghost-1")
    await asyncio.sleep(0.25)
    [second] = await consumer.reclaim(MODEL, "ghost-2", 1, 200, max_deliveries=2)
    assert second.state == "run" and second.attempt == 2 and second.last_seq == 1
    await asyncio.sleep(0.25)

    await make_worker(lease_s=0.2, max_deliveries=2)

    async def failed() -> bool:
        job = await store.get_job(MODEL, job_id)
        return job.status == "failed"
    await wait_for(failed)
    job = await store.get_job(MODEL, job_id)
    assert job.error.code == "dead_letter" and job.error.status == 500
    events = await store.read_events(MODEL, job_id)
    assert [e.seq for e in events] == [1, 2] and isinstance(events[-1], Error)
    assert events[-1].code == "dead_letter"
    [(_, dead)] = await redis.xrange(keys.dead(MODEL))
    assert dead[b"job"].decode() == job_id and dead[b"entry"] == first.entry_id
    # Acked and deleted: nothing pending, nothing left queued.
    assert await redis.xlen(keys.queue(MODEL)) == 0
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0


@pytest.mark.faults
async def test_drain_hands_unfinished_jobs_to_a_peer_at_once(make_worker, redis, keys, figures):
    # A long lease: the peer must take the job because it was handed back, not because it lapsed.
    a = await make_worker(delay_s=0.02, lease_s=30.0, drain_timeout_s=0.3)
    client = Client(redis, a.queue)
    job_id = await client.start("hand me back", 200)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    b = await make_worker(delay_s=0.005, lease_s=30.0)
    a.worker.stop()
    stopped_at = time.monotonic()
    events = await client.finish()
    handed_over_s = time.monotonic() - stopped_at

    assert_seamless(events, "hand me back", 200)
    assert not any(isinstance(e, Error) for e in events)
    job = await b.queue.get_job(MODEL, job_id)
    assert job.status == "done" and job.worker == b.worker.worker_id
    assert await redis.hget(keys.job(MODEL, job_id), "handoffs") == b"1"
    await asyncio.wait_for(a.task, 10)
    assert handed_over_s < 10  # far below the 30 s lease
    print(f"handed over and finished in {handed_over_s:.2f} s (lease 30 s)")
    figures.requests_sent, figures.completed = 1, 1
    figures.seconds["handed_over_and_finished_s"] = handed_over_s


@pytest.mark.faults
async def test_the_last_worker_hands_its_jobs_back_and_the_next_worker_continues_them(make_worker, redis, keys,
                                                                                      figures):
    """A rolling restart or scale to zero: the model's last worker stops with a job mid-stream. The
    job goes back to the queue (not failed: queues absorb a gap with no worker) and the next
    worker to start continues it from its published tokens; the client sees one seamless run."""
    a = await make_worker(delay_s=0.02, lease_s=30.0, drain_timeout_s=0.2)
    client = Client(redis, a.queue)
    job_id = await client.start("last one out", 120)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    a.worker.stop()
    await asyncio.wait_for(a.task, 10)
    job = await a.queue.get_job(MODEL, job_id)
    assert job.status == "queued" and job.worker == "" and job.error is None
    published = len(client.events)
    await asyncio.sleep(0.5)  # no worker at all for a while: the job waits, the client keeps waiting
    assert len(client.events) == published and not client.task.done()
    started = time.monotonic()
    await make_worker(delay_s=0.002, lease_s=30.0)
    events = await client.finish()
    assert_seamless(events, "last one out", 120)
    assert not any(isinstance(e, Error) for e in events)
    assert await redis.hget(keys.job(MODEL, job_id), "handoffs") == b"1"
    figures.requests_sent, figures.completed = 1, 1
    figures.seconds["next_worker_finished_s"] = time.monotonic() - started


async def test_heartbeat_keeps_a_long_job_on_its_worker(make_worker, redis, keys):
    """A job that runs for several leases is never reclaimed while its worker is alive."""
    # A lease of 1.2 s, not shorter: a busy shared CI box once stalled this process for 0.6 s, and
    # a stalled worker losing its job is the designed outcome, not what this test is about.
    a = await make_worker(delay_s=0.01, lease_s=1.2)
    b = await make_worker(delay_s=0.01, lease_s=1.2)
    job_id = await submit(a.queue, "long", 500)  # ~5 s: four leases

    async def done() -> bool:
        return (await a.queue.get_job(MODEL, job_id)).status == "done"
    await wait_for(done, timeout=20)
    job = await a.queue.get_job(MODEL, job_id)
    assert job.attempt == 1
    assert job.result.choices[0].token_ids == expected_ids("long", 500)
    assert not a.worker.engine.aborted and not b.worker.engine.aborted


def test_continuation_plan_uses_prompt_and_published_tokens():
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(max_tokens=10, min_tokens=4, temperature=0))
    prior = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[5, 6], text="xy")]),
             Tokens(seq=2, deltas=[TokenDelta(token_ids=[7], text="z")])]
    plan = plan_continuation(req, prior, [1, 2, 3])
    assert plan.request.prompt_token_ids == [1, 2, 3, 5, 6, 7] and plan.request.prompt is None
    assert plan.request.sampling.max_tokens == 7 and plan.request.sampling.min_tokens == 1
    assert plan.seq == 2 and plan.emitted == 3 and plan.prompt_tokens == 3
    assert plan.builder.result().choices[0].text == "xyz"
    # Nothing published yet: the original request, unchanged.
    assert plan_continuation(req, [], None).request is req


@pytest.mark.parametrize(("sampling", "prompt_ids"), [
    ({"beam_width": 2}, [1, 2, 3]), ({}, None), ({"n": 2, "structured": StructuredOutput(regex="[a-z]+")}, None),
])
def test_jobs_that_cannot_continue_seamlessly_fail_clearly(sampling, prompt_ids):
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(max_tokens=10, **sampling))
    prior = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="x")])]
    with pytest.raises(WorkerLost):
        plan_continuation(req, prior, prompt_ids)


async def test_housekeeping_reports_orphans_and_removes_only_empty_dead_consumers(redis, keys, prefix, monkeypatch):
    from workers.housekeeping import sweeps
    from workers.housekeeping.housekeeper import Housekeeper

    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    await submit(store, "orphan", 5)
    await consumer.pick(MODEL, "dead-with-job", 1)  # delivered, never answered
    await redis.xgroup_createconsumer(keys.queue(MODEL), GROUP, "dead-empty")  # holds nothing
    await asyncio.sleep(0.3)
    monkeypatch.setattr(sweeps, "STALE_CONSUMER_MS", 100)
    settings = load_settings({}, prefix=prefix, served_model_name=MODEL, lease_s=0.2)
    # A sweep enqueues no arq job and sends no webhook: no arq or HTTP client.
    hk = Housekeeper(settings=settings, keys=keys, redis=redis, queue=store, arq=None, http=None)
    stats = await sweeps.sweep(hk)
    assert stats["orphaned"] == 1 and stats["oldest_orphan_s"] >= 0.2 and stats["consumers_removed"] == 1
    names = {c["name"] for c in await redis.xinfo_consumers(keys.queue(MODEL), GROUP)}
    assert names == {b"dead-with-job"}, "a consumer that still holds an entry is never deleted"


async def test_a_worker_out_of_engine_restarts_exits_and_a_peer_continues_its_job(make_worker, redis, keys):
    """Past LLMQ_ENGINE_RESTARTS an engine death is fatal for the worker, not for the job: the
    worker writes nothing more about it and exits (to be restarted); the lease lapses and a peer
    continues the job seamlessly (tests/integration/test_engine_recovery.py: the rebuilds before)."""
    a = await make_worker(delay_s=0.02, die_after=15, engine_restarts=0)
    client = Client(redis, a.queue)
    job_id = await client.start("engine dies", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    b = await make_worker(delay_s=0.005)
    await asyncio.wait_for(a.task, 10)  # A drains and exits on its own
    assert a.worker.failed  # so `python -m workers` exits non-zero and gets restarted
    events = await client.finish()
    assert_seamless(events, "engine dies", 60)
    job = await b.queue.get_job(MODEL, job_id)
    assert job.status == "done" and job.worker == b.worker.worker_id and job.attempt == 2
    assert await redis.xlen(keys.queue(MODEL)) == 0
