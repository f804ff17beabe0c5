"""Affinity in the pull, on real Redis (shared/lua/read.lua): a job whose prefix key or adapter
another live worker holds is left for it, for at most the wait; fair share skips to the next tenant
meanwhile; a worker alone, a dead holder, or affinity off pick as before; a preempted job is left to
the worker that ran it. The pick is called as workers call it (``Consumer.pick``), two consumers
standing for two workers."""

from __future__ import annotations

import asyncio

import pytest

from shared.admission import new_job
from shared.keys import Keys
from shared.queue import Consumer, JobStore, now_ms
from shared.schemas import AdapterSpec, GenerationRequest, JobRecord, SamplingParams
from shared.scripts import NO_AFFINITY, Affinity, Candidate
from shared.status import render, snapshot
from tests.support import inprocess_workers
from tests.support.waiting import eventually

MODEL = "m"
WAIT = Affinity(wait_ms=10_000, hold_ms=60_000)  # long enough that only the test ends a wait


@pytest.fixture
async def consumer(redis, prefix):
    q = Consumer(redis, Keys(prefix))
    await q.ensure_group(MODEL)
    for worker in ("w1", "w2"):  # two live workers in the model's ready set
        await redis.zadd(Keys(prefix).workers(MODEL), {worker: now_ms() + 600_000})
    return q


@pytest.fixture
def store(redis, prefix):
    return JobStore(redis, Keys(prefix))


def job(tenant: str = "t", conversation: str | None = "c1", adapter: str | None = None) -> JobRecord:
    req = GenerationRequest(model=MODEL, prompt="hi", sampling=SamplingParams(max_tokens=4), cache_key=conversation,
                            adapter=AdapterSpec(name=adapter, source="/a") if adapter else None)
    return new_job(req, owner="", default_timeout_s=None, tenant=tenant)


async def pick(queue: Consumer, worker: str, affinity: Affinity = WAIT, count: int = 4) -> tuple[list[str], int]:
    picked = await queue.pick(MODEL, worker, count, affinity=affinity)
    return [d.job_id for d in picked.deliveries], picked.wake_ms


async def counters(queue: JobStore) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await queue.redis.hgetall(queue.keys.affinity(MODEL))).items()}


async def test_a_conversations_next_turn_waits_for_the_worker_that_holds_it(store, consumer):
    first = await store.enqueue(job())
    assert await pick(consumer, "w1") == ([first], 0)  # nobody held it: w1 takes it, and holds it now
    record = (await store.get_jobs(MODEL, [first]))[0]
    assert await store.redis.get(store.keys.holder(MODEL, f"p:{record.affinity}")) == b"w1"
    turn = await store.enqueue(job())
    ids, wake = await pick(consumer, "w2")
    assert ids == [] and 9_000 < wake <= 10_000  # left for w1; w2 may block only until it is anyone's
    assert await pick(consumer, "w1") == ([turn], 0)
    assert await counters(store) == {"waits": 1, "hits": 1}


async def test_a_preempted_job_is_left_for_the_worker_that_ran_it(store, consumer):
    """docs/tenants.md#preemption: a job given back by a preemption waits again with its prefix
    key, and the pick leaves it to the worker that ran it, as any turn of its conversation; charged
    once, however often it is picked."""
    given, kept = await store.enqueue(job("heavy", "c1")), await store.enqueue(job("heavy", "c2"))
    picked = await consumer.pick(MODEL, "w1", 2, affinity=WAIT)
    [d] = [d for d in picked.deliveries if d.job_id == given]
    counter = await store.redis.hget(store.keys.tenant(MODEL, "heavy"), "vtc")
    light = await store.enqueue(job("light", None))
    swap = await consumer.preempt(MODEL, "w1", [Candidate(given, d.entry_id, d.attempt, d.level, 2, 1)],
                               max_failed=3, max_preemptions=3)
    assert swap.victim == given and [p.job_id for p in swap.deliveries] == [light]
    ids, wake = await pick(consumer, "w2")
    assert ids == [] and wake > 0  # left for w1, which ran it
    assert await pick(consumer, "w1") == ([given], 0)
    record = (await store.get_jobs(MODEL, [given]))[0]
    assert (record.status, record.attempt, record.preemptions, record.worker) == ("running", 2, 1, "w1")
    assert await store.redis.hget(store.keys.tenant(MODEL, "heavy"), "vtc") == counter, "charged once"
    assert kept in [p.job_id for p in picked.deliveries]


async def test_the_wait_is_bounded(store, consumer):
    short = Affinity(wait_ms=150, hold_ms=60_000)
    await store.enqueue(job())
    await pick(consumer, "w1", short)
    turn = await store.enqueue(job())
    assert (await pick(consumer, "w2", short))[0] == []
    await asyncio.sleep(0.2)
    assert (await pick(consumer, "w2", short))[0] == [turn]  # its wait is over: anyone's
    assert (await counters(store))["misses"] == 1
    # w2 served the conversation last: it holds it now.
    nxt = await store.enqueue(job())
    assert (await pick(consumer, "w1", short))[0] == []
    assert (await pick(consumer, "w2", short))[0] == [nxt]


async def test_fair_share_asks_the_next_tenant_meanwhile_and_keeps_each_tenants_order(store, consumer):
    await store.enqueue(job("a", "conv-a"))
    await pick(consumer, "w1")  # w1 holds conv-a
    a1 = await store.enqueue(job("a", "conv-a"))
    a2 = await store.enqueue(job("a", None))
    b1 = await store.enqueue(job("b", None))
    # w2 passes over tenant a (its oldest is w1's), and takes b's; a's second job waits behind its first.
    assert (await pick(consumer, "w2"))[0] == [b1]
    assert (await pick(consumer, "w1"))[0] == [a1, a2]


async def test_an_adapters_jobs_go_to_a_worker_that_has_it_loaded(store, consumer):
    await store.enqueue(job(conversation=None, adapter="sql"))
    await pick(consumer, "w1")  # w1 loaded it
    nxt = await store.enqueue(job(conversation=None, adapter="sql"))
    assert (await pick(consumer, "w2"))[0] == []
    # A worker whose engine holds the adapter too takes it as its own.
    loaded = Affinity(WAIT.wait_ms, WAIT.hold_ms, adapters=("sql",))
    assert (await pick(consumer, "w2", loaded))[0] == [nxt]
    # A prefix goes first: both have the adapter, w1 served the conversation.
    first = await store.enqueue(job(conversation="conv-1", adapter="sql"))
    assert (await pick(consumer, "w1", loaded))[0] == [first]
    turn = await store.enqueue(job(conversation="conv-1", adapter="sql"))
    assert (await pick(consumer, "w2", loaded))[0] == []
    assert (await pick(consumer, "w1"))[0] == [turn]


async def test_off_alone_or_held_by_the_dead_the_pick_is_the_plain_one(store, consumer, redis, prefix):
    await store.enqueue(job())
    await pick(consumer, "w1")
    turn = await store.enqueue(job())
    assert (await pick(consumer, "w2", NO_AFFINITY))[0] == [turn]  # off
    turn = await store.enqueue(job())
    await redis.zadd(Keys(prefix).workers(MODEL), {"w1": now_ms() - 1})  # w1's heartbeat lapsed
    assert (await pick(consumer, "w2"))[0] == [turn]  # held by a dead worker: anyone's (w2 alone)
    await redis.zadd(Keys(prefix).workers(MODEL), {"w3": now_ms() + 600_000})
    await redis.set(Keys(prefix).holder(MODEL, f"p:{(await store.get_jobs(MODEL, [turn]))[0].affinity}"), "w1")
    turn = await store.enqueue(job())
    assert (await pick(consumer, "w2"))[0] == [turn]  # w1 is not live: its hold is void
    assert "waits" not in await counters(store)


# --- with the real worker loop ------------------------------------------------------------------

make_worker = inprocess_workers.make_worker


async def test_the_worker_loop_leaves_a_turn_to_its_holder_and_takes_it_once_the_wait_is_over(make_worker):
    """Two in-process workers of one slot each (scripted engines). A conversation's turns go to
    the worker that ran its first; when that worker is busy, the other takes the next turn once
    its wait (300 ms) is over, not after its blocking read's 5 s."""
    settings = {"max_num_seqs": 1, "affinity_ms": 300, "block_ms": 5_000}
    first = await make_worker(delay_s=0.001, **settings)
    queue = first.queue

    async def run(conversation: str | None, tokens: int = 2) -> JobRecord:
        req = GenerationRequest(model=inprocess_workers.MODEL, prompt="hi", cache_key=conversation,
                                sampling=SamplingParams(max_tokens=tokens))
        job_id = await queue.enqueue(new_job(req, owner="", default_timeout_s=None, tenant="t"))

        async def ended() -> JobRecord | None:
            [record] = await queue.get_jobs(inprocess_workers.MODEL, [job_id])
            return record if record is not None and record.status == "done" else None
        return await eventually(ended, timeout_s=30, what="the job to end")

    second = await make_worker(delay_s=0.001, **settings)
    by_id = {w.worker.worker_id: w for w in (first, second)}
    holder = by_id[(await run("conv")).worker]  # whoever took the first turn holds the conversation
    other = second if holder is first else first
    for _ in range(5):
        assert (await run("conv")).worker == holder.worker.worker_id
    # llmq-status shows who holds what.
    [model] = (await snapshot(queue.redis, queue.keys)).models
    assert [(h.worker, h.prefixes, h.adapters) for h in model.held] == [(holder.worker.worker_id, 1, [])]
    assert "affinity holders" in render(await snapshot(queue.redis, queue.keys))
    # The holder busy with a long turn (its one slot), the next turn goes to the other after the wait.
    busy = asyncio.create_task(run("conv", tokens=3_000))
    await eventually(lambda: holder.worker.slots.running == 1 and other.worker.slots.running == 0,
                     what="the holder, and only it, to be busy")
    turn = await run("conv")
    assert turn.worker == other.worker.worker_id
    assert 250 <= turn.started_at - turn.queued_at < 2_500, "a peer took it once its wait was over"
    # Cancelled and awaited: a poll cut off mid-connect, left to the collector, warns of an
    # unclosed stream in whichever later test it is found (seen once in CI).
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)
