"""Deadlines under overload, on a real redis-server (docs/guarantees.md#slos): admission that
predicts a request's time to first token and refuses one that cannot meet its SLO, a tenant's
line ordered by first-token deadline (EDF) with fair share between tenants held, a job whose
first-token deadline passed never started, and a waiting job's standing falling as the queue drains."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared import scripts
from shared.admission import new_job
from shared.errors import SloUnattainable
from shared.queue import Consumer, JobStore, now_ms
from shared.schemas import GenerationRequest, JobRecord, SamplingParams, Slo
from shared.slo import Capacity, Standing
from shared.tenants import TenantConfig

MODEL = "m1"
# Two slots; a job generates 100 tokens, and the model 100 tokens/s: with both slots busy one
# job ends a second (Slo.wait_ms), and a prompt is prefilled at 1000 tokens/s.
CAPACITY = Capacity(slots=2, prefill_tps=1000.0, decode_tps=100.0, generated_per_job=100.0)


def job(*, ttft_ms: int | None = None, tenant: str = "default", prompt: str = "hi",
        now: float | None = None) -> JobRecord:
    req = GenerationRequest(model=MODEL, prompt=prompt, sampling=SamplingParams(max_tokens=100),
                            slo=Slo(ttft_ms=ttft_ms) if ttft_ms else None)
    return new_job(req, owner="", tenant=tenant, default_timeout_s=None, now_ms=now)


async def picked(consumer: Consumer, count: int, worker: str = "w") -> list[str]:
    return [d.job_id for d in (await consumer.pick(MODEL, worker, count)).deliveries]


async def test_a_request_predicted_past_its_slo_is_refused_before_it_is_queued(redis, keys):
    store = JobStore(redis, keys)
    ahead = [job(ttft_ms=1200) for _ in range(3)]  # their first tokens are due before its
    for r in ahead:
        await store.enqueue(r, capacity=CAPACITY)
    # Three ahead, two slots free: it starts once two jobs have ended, in 2 s, plus its prefill.
    late = job(ttft_ms=1500)
    with pytest.raises(SloUnattainable) as refused:
        await store.enqueue(late, capacity=CAPACITY)
    assert refused.value.status == 429 and refused.value.code == "slo_unattainable"
    assert refused.value.retry_after_s == 1  # ceil((2001 ms predicted - 1500 ms) / 1000)
    assert "2001 ms" in str(refused.value)
    assert await store.get_job(MODEL, late.id) is None, "a refused request leaves nothing behind"
    assert await store.depth(MODEL) == 3
    # A looser SLO fits, and its prediction stays on its record for the worker's error metric.
    loose = job(ttft_ms=2500)
    assert await store.enqueue(loose, capacity=CAPACITY) == loose.id
    assert await redis.hget(keys.job(MODEL, loose.id), "predicted_ttft") == b"2001"
    # Due before the loose one, after the three: three ahead again; Retry-After is how far past.
    slower = msgspec.structs.replace(CAPACITY, generated_per_job=300.0)  # a job ends every 3 s
    with pytest.raises(SloUnattainable) as refused:
        await store.enqueue(job(ttft_ms=1300), capacity=slower)
    assert refused.value.retry_after_s == 5  # ceil((6001 - 1300) / 1000)
    # A request without an SLO is never refused for one, however long its wait.
    assert await store.enqueue(plain := job(), capacity=CAPACITY) == plain.id
    assert await redis.hget(keys.job(MODEL, plain.id), "predicted_ttft") == b"3001"  # behind all four


async def test_admission_refuses_nothing_while_no_warm_worker_has_measured_its_speed(redis, keys):
    store = JobStore(redis, keys)
    for _ in range(5):
        await store.enqueue(job(), capacity=Capacity(slots=2))
    tight = job(ttft_ms=1)
    assert await store.enqueue(tight, capacity=Capacity(slots=2)) == tight.id
    assert await redis.hget(keys.job(MODEL, tight.id), "predicted_ttft") is None


async def test_a_tenants_line_is_earliest_first_token_deadline_first_then_arrival(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    t0 = now_ms()
    plain_1, loose, plain_2, tight = job(now=t0), job(ttft_ms=60_000, now=t0 + 1), job(now=t0 + 2), \
        job(ttft_ms=30_000, now=t0 + 3)
    for r in (plain_1, loose, plain_2, tight):
        await store.enqueue(r)
    assert await picked(consumer, 4) == [tight.id, loose.id, plain_1.id, plain_2.id]


async def test_edf_orders_a_tenants_own_jobs_and_never_takes_another_tenants_share(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    urgent = [job(ttft_ms=60_000 - 1000 * i, tenant="urgent") for i in range(6)]  # each due before the last
    plain = [job(tenant="plain") for _ in range(6)]
    for a, b in zip(urgent, plain, strict=True):
        await store.enqueue(a, tenant=TenantConfig())
        await store.enqueue(b, tenant=TenantConfig())
    order, urgent_order = [], []
    for _ in range(12):
        [one] = await picked(consumer, 1)
        order.append("urgent" if one in {r.id for r in urgent} else "plain")
        if order[-1] == "urgent":
            urgent_order.append(one)
    # Equal weights, equal jobs: the tenants alternate, whatever deadlines one of them sends.
    assert order[:10].count("urgent") == 5 and order[:10].count("plain") == 5
    assert all(order[i] != order[i + 1] for i in range(9)), order
    # Within the urgent tenant, earliest deadline first: the last queued went first.
    assert urgent_order == [r.id for r in reversed(urgent)]


async def test_a_job_whose_first_token_deadline_passed_is_never_started(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    late, fine = job(ttft_ms=50), job(ttft_ms=60_000)
    await store.enqueue(late)
    await store.enqueue(fine)
    await asyncio.sleep(0.1)
    deliveries = (await consumer.pick(MODEL, "w", 2)).deliveries
    states = {d.job_id: d.state for d in deliveries}
    assert states == {late.id: "late", fine.id: "run"}
    assert await redis.hget(keys.job(MODEL, late.id), "started_at") is None


async def test_a_job_that_could_not_send_its_first_token_in_time_is_not_started(redis, keys):
    """Its deadline still ahead at the pick, but nearer than the worker's lead (its mean time from a
    start to a first token): it could not make it, and its slot goes to one that can."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    near, far = job(ttft_ms=300), job(ttft_ms=60_000)
    await store.enqueue(near)
    await store.enqueue(far)
    deliveries = (await consumer.pick(MODEL, "w", 2, lead_ms=1000)).deliveries
    assert {d.job_id: d.state for d in deliveries} == {near.id: "late", far.id: "run"}


async def test_a_job_that_ran_before_is_never_ended_by_its_first_token_deadline(redis, keys):
    """A lost (or preempted) job may have sent tokens: its first-token deadline no longer ends it."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    r = job(ttft_ms=50)
    await store.enqueue(r)
    [d] = (await consumer.pick(MODEL, "w1", 1)).deliveries
    assert d.state == "run"
    await asyncio.sleep(0.1)  # its first-token deadline passes while w1 holds it, then w1 is lost
    [again] = await consumer.reclaim(MODEL, "w2", 1, lease_ms=10)
    assert (again.job_id, again.state, again.lost_worker) == (r.id, "run", "w1")


async def test_a_waiting_jobs_standing_falls_as_the_queue_drains(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    jobs = [job() for _ in range(6)]
    for r in jobs:
        await store.enqueue(r)
    last = jobs[-1].id
    standings = [await store.position(MODEL, last, CAPACITY)]
    for _ in range(4):  # a job ahead starts and ends
        [d] = (await consumer.pick(MODEL, "w", 1)).deliveries
        await consumer.ack(MODEL, d.entry_id, d.level)
        standings.append(await store.position(MODEL, last, CAPACITY))
    assert [s.position for s in standings if s] == [5, 4, 3, 2, 1]
    # Two free slots: 5 ahead is 4 jobs to end, a second each; with one ahead, a slot is free.
    assert [s.eta_s for s in standings if s] == [4.0, 3.0, 2.0, 1.0, 0.0]
    assert await store.position(MODEL, last, Capacity()) == Standing(position=1, eta_s=None)
    assert await picked(consumer, 2) == [jobs[-2].id, last]
    assert await store.position(MODEL, last, CAPACITY) is None, "it runs: it no longer waits"


async def test_the_standing_counts_other_tenants_by_their_share(redis, keys):
    store = JobStore(redis, keys)
    for _ in range(10):
        await store.enqueue(job(tenant="big"))
    mine = [job(tenant="small") for _ in range(3)]
    for r in mine:
        await store.enqueue(r)
    # Its third job starts after its own two and, alternating, three of big's.
    standing = await store.position(MODEL, mine[2].id, CAPACITY)
    assert standing is not None and standing.position == 2 + 3


@pytest.mark.parametrize("preempted", [False, True])
@pytest.mark.parametrize("ttft_ms", [None, 5000])
async def test_the_line_score_python_computes_is_the_one_lua_gives(redis, keys, preempted, ttft_ms):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    r = job(ttft_ms=ttft_ms)
    await store.enqueue(r)
    line = keys.tenant_waiting(MODEL, "default")
    if preempted:  # as preempt.lua puts a job back: Fair.order(now, nil, true)
        [member] = await redis.zrange(line, 0, 0)
        at = now_ms()
        await redis.eval(scripts.source(scripts.POSITION).split("-- A waiting job's standing")[0]
                         + "redis.call('ZADD', KEYS[1], Fair.order(ARGV[1], nil, true), ARGV[2])", 1, line, at, member)
        await redis.hset(keys.job(MODEL, r.id), "preempted_at", at)
    [(_, score)] = await redis.zrange(line, 0, 0, withscores=True)
    raw = await redis.hmget(keys.job(MODEL, r.id), ["queued_at", "first_token_deadline", "preempted_at"])
    expected = scripts.line_score(float(raw[0]), float(raw[1]) if raw[1] else None, float(raw[2]) if raw[2] else None)
    assert score == expected
