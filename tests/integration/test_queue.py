"""Queue and event operations against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

from shared.codec import decode_event
from shared.events import Error, TokenDelta, Tokens
from shared.keys import GROUP
from shared.queue import Consumer, JobStore, Outbound, now_ms
from shared.schemas import GenerationRequest, JobRecord
from tests.support.event_log import finished_log

MODEL = "m1"


def record(prompt: str = "hi") -> JobRecord:
    return JobRecord(id=uuid.uuid4().hex, model=MODEL, request=GenerationRequest(prompt=prompt), queued_at=now_ms())


async def test_enqueue_writes_record_and_stream_entry_together(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    rec = record("hello")
    assert await store.enqueue(rec) == rec.id

    stored = await store.get_job(MODEL, rec.id)
    assert stored is not None and stored.status == "queued" and stored.request.prompt == "hello"
    # It waits its tenant's turn: in the waiting stream and its tenant's list, not yet picked.
    entries = await redis.xrange(keys.waiting(MODEL))
    assert [(f[b"job"].decode(), f[b"tenant"].decode()) for _, f in entries] == [(rec.id, "default")]
    listed = await redis.zrange(keys.tenant_waiting(MODEL, "default"), 0, -1)
    assert listed == [f"{entries[0][0].decode()} {rec.id}".encode()]
    assert await redis.xlen(keys.queue(MODEL)) == 0
    assert stored.tenant == "default" and stored.estimate == 1 + 1 + 16  # "hello": 5 bytes // 4 + 1; max_tokens 16


async def test_enqueue_is_atomic_for_a_concurrent_reader(redis, keys):
    """A worker never sees a queue entry whose record is not there yet."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    records = [record(f"p{i}") for i in range(200)]
    seen: list[str] = []

    async def reader() -> None:
        while len(seen) < len(records):
            picked = await consumer.pick(MODEL, "reader", 50)
            if not picked.deliveries:  # as a worker does: wait for work, then pick again
                await consumer.wait_for_work(MODEL, picked.tops, 100)
            for d in picked.deliveries:
                assert d.state == "run", d
                seen.append(d.job_id)

    task = asyncio.create_task(reader())
    await asyncio.gather(*(store.enqueue(r) for r in records))
    await asyncio.wait_for(task, 10)
    assert sorted(seen) == sorted(r.id for r in records)


async def test_repeated_idempotency_key_returns_the_first_job(redis, keys):
    queue = JobStore(redis, keys)
    first, second = record("a"), record("b")
    assert await queue.enqueue(first, "key-1") == first.id
    assert await queue.enqueue(second, "key-1") == first.id
    assert await queue.get_job(MODEL, second.id) is None
    assert await queue.depth(MODEL) == 1
    other = record("c")
    assert await queue.enqueue(other, "key-2") == other.id


async def test_two_consumers_share_jobs_without_duplicates(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    records = [record(str(i)) for i in range(100)]
    for r in records:
        await store.enqueue(r)
    got: dict[str, list[str]] = {"w1": [], "w2": []}

    async def consume(name: str) -> None:
        while True:
            batch = (await consumer.pick(MODEL, name, 7)).deliveries
            if not batch:
                return
            got[name].extend(d.job_id for d in batch)
            await asyncio.sleep(0)

    await asyncio.gather(consume("w1"), consume("w2"))
    assert got["w1"] and got["w2"], "both consumers should take work"
    assert not set(got["w1"]) & set(got["w2"])
    assert sorted(got["w1"] + got["w2"]) == sorted(r.id for r in records)


async def test_jobs_queued_before_the_group_exists_are_delivered(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec = record()
    await store.enqueue(rec)
    await consumer.ensure_group(MODEL)
    assert [d.job_id for d in (await consumer.pick(MODEL, "w", 10)).deliveries] == [rec.id]


async def test_waiting_for_work_wakes_on_a_job_queued_after_the_pick_and_ends_at_once_on_stop(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    picked = await consumer.pick(MODEL, "w", 1)
    assert picked.deliveries == [] and len(picked.tops) == 3
    rec = record()
    await store.enqueue(rec)  # after the pick, before the wait: the wait still sees it
    assert await consumer.wait_for_work(MODEL, picked.tops, 5_000)
    assert [d.job_id for d in (await consumer.pick(MODEL, "w", 1)).deliveries] == [rec.id]
    stop = asyncio.Event()
    picked = await consumer.pick(MODEL, "w", 1)
    waiting = asyncio.create_task(consumer.wait_for_work(MODEL, picked.tops, 5_000, stop))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(waiting, 1) is False
    assert not await consumer.wait_for_work(MODEL, picked.tops, 50)  # nothing queued: it times out


async def test_event_log_resumes_by_sequence_and_finish_acks_the_entry(redis, keys):
    store, consumer = JobStore(redis, keys, result_ttl_s=60), Consumer(redis, keys, result_ttl_s=60)
    await consumer.ensure_group(MODEL)
    rec = record()
    await store.enqueue(rec)
    [delivery] = (await consumer.pick(MODEL, "w", 1)).deliveries
    assert delivery.attempt == 1
    running = await store.get_job(MODEL, rec.id)
    assert running.status == "running" and running.worker == "w" and running.started_at

    events, done, result = finished_log(prompt_tokens=2)
    await consumer.flush(MODEL, [Outbound.of(rec.id, e) for e in events])
    await consumer.flush(MODEL, [Outbound.of(rec.id, done, entry_id=delivery.entry_id, result=result)])

    assert [e.seq for e in await store.read_events(MODEL, rec.id)] == [1, 2, 3, 4]
    assert [e.seq for e in await store.read_events(MODEL, rec.id, after_seq=2)] == [3, 4]
    assert await store.read_events(MODEL, rec.id, after_seq=4) == []

    finished = await store.get_job(MODEL, rec.id)
    assert finished.status == "done"
    assert finished.result.choices[0].text == "t1t2t3!"
    assert finished.result.choices[0].finish_reason == "length"
    # acknowledged and deleted together: nothing pending, nothing left in the stream
    assert await redis.xlen(keys.queue(MODEL)) == 0
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0
    assert 0 < await redis.ttl(keys.job(MODEL, rec.id)) <= 60
    assert 0 < await redis.ttl(keys.events(MODEL, rec.id)) <= 60


async def test_a_retried_flush_writes_each_event_once(redis, keys):
    """A flush retried after a lost reply (redis-py retries on a dropped connection) must neither
    log nor publish an event twice: the client would see a token twice."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec = record()
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.live(MODEL, rec.id))
    first = [Outbound.of(rec.id, Tokens(seq=i, deltas=[TokenDelta(token_ids=[i])])) for i in (1, 2)]
    await consumer.flush(MODEL, first)
    await consumer.flush(MODEL, first)  # the retry: both already logged
    await consumer.flush(MODEL, [first[1], Outbound.of(rec.id, Tokens(seq=3, deltas=[]))])
    assert [e.seq for e in await store.read_events(MODEL, rec.id)] == [1, 2, 3]
    published = []
    for _ in range(30):
        message = await pubsub.get_message(timeout=0.05)
        if message is not None:
            published.append(decode_event(message["data"]).seq)
    assert published == [1, 2, 3]
    await pubsub.aclose()


async def test_cancel_before_delivery_is_seen_by_the_worker(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    rec = record()
    await store.enqueue(rec)
    assert await store.cancel(MODEL, rec.id) == "queued"
    [delivery] = (await consumer.pick(MODEL, "w", 1)).deliveries
    assert delivery.state == "cancelled"
    assert await store.cancel(MODEL, "no-such-job") is None


async def test_live_channel_gets_the_same_bytes_as_the_log(redis, keys):
    queue = Consumer(redis, keys)
    rec = record()
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.live(MODEL, rec.id))
    event = Error(seq=1, code="x", message="boom", status=500)
    await queue.flush(MODEL, [Outbound.of(rec.id, event)])
    message = None
    for _ in range(20):  # the first read returns (and hides) the subscribe confirmation
        message = message or await pubsub.get_message(timeout=0.1)
    [(_, fields)] = await redis.xrange(keys.events(MODEL, rec.id))
    assert message["data"] == fields[b"e"]
    await pubsub.aclose()
