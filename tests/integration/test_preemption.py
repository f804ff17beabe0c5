"""Preemption (docs/tenants.md#preemption) on real Redis with in-process workers and a scripted
engine deterministic in its whole context (``ContextEngine``: like greedy decoding), so a job
continued after a preemption must stream exactly what one uninterrupted run streams. The clients
are the real relay (``Client``). tests/e2e/test_preemption.py runs the same on real vLLM.

Orders are read from the records (when a job started, when the jobs it overtook ended), not from
clocks' absolute figures, which a loaded machine stretches."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from api.metrics import tenant_series
from shared.events import Error
from shared.status import render, snapshot
from tests.support import inprocess_workers
from tests.support.faults import lost_and_duplicated
from tests.support.inprocess_workers import MODEL, Client, assert_seamless, kill, wait_for
from tests.support.scripted_engine import expected_ids

make_worker = inprocess_workers.make_worker

SLOTS = 4
LONG = 400  # tokens of a flood job: 4 s at 10 ms a step, longer than the light tenant's jobs take to come
FAST = {"preempt_min_run_ms": 100, "preempt_min_tokens": 2}


async def flood(redis, queue, tenant: str, n: int, tokens: int = LONG, **kwargs) -> list[tuple[Client, str]]:
    clients = []
    for i in range(n):
        client = Client(redis, queue)
        prompt = f"{tenant} story {i}"
        await client.start(prompt, tokens, tenant=tenant, **kwargs)
        clients.append((client, prompt))
    return clients


async def running(queue, tenant: str, n: int) -> None:
    keys = queue.keys
    await wait_for(lambda: _count(queue.redis, keys.tenant_running(MODEL, tenant), n), timeout=30)


async def _count(redis, key: str, n: int) -> bool:
    return await redis.scard(key) >= n


async def finished(clients: list[tuple[Client, str]], tokens: int = LONG) -> None:
    for client, prompt in clients:
        assert_seamless(await client.finish(timeout=120), prompt, tokens)


async def test_a_light_tenant_takes_a_slot_from_a_flood_at_once_and_the_flood_streams_stay_exact(
        make_worker, redis, keys):
    """Tenant A fills every slot with long jobs and queues more; tenant B sends a short job every
    300 ms. Each of B's jobs starts before any of the A jobs running when it came has ended (it did
    not wait for a slot to free), each takes exactly one preemption, and every A stream is
    byte-identical to one run. A's records and usage say what it cost them."""
    w = await make_worker(delay_s=0.01, max_num_seqs=SLOTS, **FAST)
    heavy = await flood(redis, w.queue, "heavy", SLOTS + 2)
    await running(w.queue, "heavy", SLOTS)
    await asyncio.sleep(0.2)  # past LLMQ_PREEMPT_MIN_RUN_MS
    light = []
    for _ in range(4):
        client = Client(redis, w.queue)
        light.append((client, await client.start("quick", 8, tenant="light")))
        await asyncio.sleep(0.3)
    for client, _ in light:
        assert_seamless(await client.finish(), "quick", 8)
    await finished(heavy)

    records = {c.job_id: await w.queue.get_job(MODEL, c.job_id) for c, _ in heavy}
    for _, job_id in light:
        b = await w.queue.get_job(MODEL, job_id)
        # Every flood job ran past it, so no slot freed before it started but by a preemption.
        assert b.started_at < min(r.finished_at for r in records.values()), "it waited for a slot to free"
        assert b.attempt == 1 and b.preemptions == 0
        assert not b.runs and [(r.attempt, r.worker) for r in b.attempts()] == [(1, b.worker)]
    preempted = [r for r in records.values() if r.preemptions]
    assert sum(r.preemptions for r in preempted) == len(light), "one preemption per light job"
    for r in preempted:
        assert r.attempt == 1 + r.preemptions and r.preempted_ms > 0
        # Each start is a run of its own (the console's job view): kept, as there were several.
        runs = r.attempts()
        assert [run.attempt for run in runs] == list(range(1, r.attempt + 1))
        assert runs[-1].worker == r.worker and runs[-1].started_at == int(r.started_at)  # whole ms
        assert all(a.started_at < b.started_at for a, b in itertools.pairwise(runs))
    usage = await redis.hgetall(keys.usage(MODEL))
    assert int(usage[b"heavy:preemptions"]) == len(light)
    assert int(usage[b"heavy:generated_tokens"]) == len(heavy) * LONG, "counted once, however often preempted"
    assert int(usage[b"heavy:requests"]) == len(heavy)
    assert b"light:preemptions" not in usage
    [preemptions] = [s.value for s in w.worker.metrics.samples() if s.name == "llmq_worker_preemptions_total"]
    assert preemptions == len(light)
    # What an operator sees: /metrics' tenant series and llmq-status, both from the usage hash.
    series = {(s.name, s.labels["tenant"]): s.value for s in await tenant_series(redis, keys, MODEL, 10)}
    assert series[("llmq_tenant_preemptions_total", "heavy")] == len(light)
    assert series[("llmq_tenant_preempted_seconds_total", "heavy")] == sum(r.preempted_ms for r in preempted) / 1000
    [model] = [m for m in (await snapshot(redis, keys)).models if m.name == MODEL]
    [row] = [t for t in model.top_tenants if t.tenant == "heavy"]
    assert row.preemptions == len(light) and "waited again" in render(await snapshot(redis, keys))


async def test_two_flooding_tenants_settle_without_thrashing(make_worker, redis, keys):
    """A fills the slots first, then B floods as much: B takes half the slots by preemption and
    the two stay there, each of A's given-back jobs preempted once at most; nothing moves back."""
    w = await make_worker(delay_s=0.01, max_num_seqs=SLOTS, **FAST)
    a = await flood(redis, w.queue, "a", 3 * SLOTS, tokens=60)
    await running(w.queue, "a", SLOTS)
    await asyncio.sleep(0.2)
    b = await flood(redis, w.queue, "b", 3 * SLOTS, tokens=60)
    await finished(a, 60)
    await finished(b, 60)
    records = {t: [await w.queue.get_job(MODEL, c.job_id) for c, _ in clients] for t, clients in (("a", a), ("b", b))}
    by_tenant = {t: sum(r.preemptions for r in rs) for t, rs in records.items()}
    print(f"preemptions {by_tenant}")
    assert by_tenant["a"] == SLOTS // 2, "B took half the slots, one by one, and no more"
    assert by_tenant["b"] == 0
    assert max(r.preemptions for r in records["a"]) <= 1


async def test_a_more_urgent_job_preempts_a_less_urgent_one_of_the_same_tenant(make_worker, redis, keys):
    w = await make_worker(delay_s=0.01, max_num_seqs=SLOTS, **FAST)
    batch = await flood(redis, w.queue, "team", SLOTS, priority=2)
    await running(w.queue, "team", SLOTS)
    await asyncio.sleep(0.2)
    urgent = Client(redis, w.queue)
    await urgent.start("now please", 8, tenant="team", priority=0)
    assert_seamless(await urgent.finish(), "now please", 8)
    await finished(batch)
    done = await w.queue.get_job(MODEL, urgent.job_id)
    records = [await w.queue.get_job(MODEL, c.job_id) for c, _ in batch]
    assert done.finished_at < min(r.finished_at for r in records)
    assert sum(r.preemptions for r in records) == 1


@pytest.mark.parametrize("settings", [{"preempt": False}, {"preempt_max": 0}], ids=["off", "max-0"])
async def test_without_preemption_a_light_job_waits_for_a_slot_to_free(make_worker, redis, keys, settings):
    w = await make_worker(delay_s=0.01, max_num_seqs=SLOTS, **FAST, **settings)
    heavy = await flood(redis, w.queue, "heavy", SLOTS + 1)
    await running(w.queue, "heavy", SLOTS)
    await asyncio.sleep(0.2)
    light = Client(redis, w.queue)
    await light.start("quick", 8, tenant="light")
    assert_seamless(await light.finish(timeout=60), "quick", 8)
    await finished(heavy)
    b = await w.queue.get_job(MODEL, light.job_id)
    records = [await w.queue.get_job(MODEL, c.job_id) for c, _ in heavy]
    assert b.started_at >= min(r.finished_at for r in records), "it started once a slot freed"
    assert not any(r.preemptions for r in records)


async def test_a_preempted_job_past_its_deadline_ends_while_it_waits_again(make_worker, redis, keys):
    """The deadline counts the time a preempted job waits again: past it, it never runs again."""
    w = await make_worker(delay_s=0.01, max_num_seqs=2, **FAST)
    other = await flood(redis, w.queue, "heavy", 1)
    slow = Client(redis, w.queue)  # started last, shorter prompt: the one cheaper to resume
    await slow.start("long one", 400, tenant="heavy", timeout_s=2.0)
    await running(w.queue, "heavy", 2)
    await asyncio.sleep(0.2)
    hog = Client(redis, w.queue)
    await hog.start("hog", 300, tenant="light")  # 3 s in the slot: past the first job's deadline
    events = await slow.finish(timeout=30)
    assert isinstance(events[-1], Error) and events[-1].code == "deadline_exceeded"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    record = await w.queue.get_job(MODEL, slow.job_id)
    assert record.preemptions == 1 and record.status == "failed"
    assert_seamless(await hog.finish(timeout=30), "hog", 300)
    await finished(other)


@pytest.mark.faults
async def test_a_preempted_job_continues_on_a_peer_when_its_worker_is_killed_while_it_waits(
        make_worker, redis, keys, figures):
    """The fault-table row: the worker that preempted a job is SIGKILLed while the job waits to
    continue (and while the job that took its slot runs). A new worker continues all three jobs,
    each stream exactly one run's."""
    w = await make_worker(delay_s=0.01, max_num_seqs=2, **FAST)
    other = await flood(redis, w.queue, "heavy", 1, tokens=400)
    first = Client(redis, w.queue)  # started last, shorter prompt: the one cheaper to resume
    await first.start("first in", 120, tenant="heavy")
    await running(w.queue, "heavy", 2)
    await asyncio.sleep(0.2)
    second = Client(redis, w.queue)
    await second.start("cut in", 120, tenant="light")

    async def preempted() -> bool:
        return (await w.queue.get_job(MODEL, first.job_id)).preemptions == 1
    await wait_for(preempted, timeout=10)
    await wait_for(lambda: _count(redis, keys.tenant_running(MODEL, "light"), 1))
    await kill(w)
    killed_at = time.monotonic()
    assert (await w.queue.get_job(MODEL, first.job_id)).status == "queued"
    peer = await make_worker(delay_s=0.005, max_num_seqs=2)
    streams = [(first, "first in", 120), (second, "cut in", 120), (other[0][0], other[0][1], 400)]
    for client, prompt, tokens in streams:
        events = await client.finish(timeout=60)
        lost, duplicated = lost_and_duplicated(expected_ids(prompt, tokens), client.token_ids())
        figures.tokens_lost += lost
        figures.tokens_duplicated += duplicated
        assert_seamless(events, prompt, tokens)
        assert (await peer.queue.get_job(MODEL, client.job_id)).worker == peer.worker.worker_id
    figures.requests_sent = figures.completed = len(streams)
    figures.seconds["all_finished_after_kill_s"] = time.monotonic() - killed_at
