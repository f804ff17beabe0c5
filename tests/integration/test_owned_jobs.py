"""The fence a flush checks with one read (Keys.fence, in the job's token shard): each way a job
leaves its worker (a peer's claim, a hand-back, an expiry, its end) refuses that worker's later
events, as the record's (worker, attempt) did, and moves or clears the job's fence entry; a
follower added mid-stream gets the next flush; the entry is gone once the job has ended.
Each refusal has a control: the same event from the owner at its attempt is written."""

from __future__ import annotations

import uuid

from shared.errors import JobCancelled
from shared.events import Done, Error, TokenDelta, Tokens
from shared.keys import shard_of
from shared.queue import Consumer, Held, JobStore, Outbound, now_ms
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, JobRecord

MODEL = "owned"


def _record() -> JobRecord:
    return JobRecord(id=uuid.uuid4().hex, model=MODEL, request=GenerationRequest(prompt="hi"), queued_at=now_ms())


def _tokens(job_id: str, seq: int, attempt: int) -> Outbound:
    return Outbound.of(job_id, Tokens(seq=seq, deltas=[TokenDelta(token_ids=[seq], text=f"t{seq}")]),
                       attempt=attempt)


async def _picked(store: JobStore, consumer: Consumer, worker: str = "w1"):
    await consumer.ensure_group(MODEL)
    rec = _record()
    await store.enqueue(rec)
    [delivery] = (await consumer.pick(MODEL, worker, 1)).deliveries
    return rec, delivery


async def _logged(queue: JobStore, job_id: str) -> list[int]:
    return [e.seq for e in await queue.read_events(MODEL, job_id)]


async def _fenced(redis, keys, job_id: str) -> bytes | None:
    """The job's entry in its token shard's fence: ``<attempt>@<worker>[ <followers>]``, or None."""
    return await redis.hget(keys.fence(MODEL, shard_of(job_id)), job_id)


async def test_the_owner_writes_and_a_peers_claim_refuses_the_former_owner(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec, d = await _picked(store, consumer)
    assert await _fenced(redis, keys, rec.id) == f"{d.attempt}@w1".encode()
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 1, d.attempt)], "w1")).lost == []  # control
    [taken] = await consumer.take_over(MODEL, "w1", "w2", 1)
    assert taken.attempt == d.attempt + 1
    assert await _fenced(redis, keys, rec.id) == f"{taken.attempt}@w2".encode()
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 2, d.attempt)], "w1")).lost == [rec.id]
    # The former owner at the new attempt is no owner either: the fence is (worker, attempt).
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 2, taken.attempt)], "w1")).lost == [rec.id]
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 2, taken.attempt)], "w2")).lost == []
    assert await _logged(store, rec.id) == [1, 2]


async def test_a_hand_back_refuses_the_worker_that_handed_the_job_back(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec, d = await _picked(store, consumer)
    assert await consumer.renew(MODEL, "w1", [Held(rec.id, d.entry_id, d.attempt)]) == []  # a renewal keeps it
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 1, d.attempt)], "w1")).lost == []
    assert await _fenced(redis, keys, rec.id) == f"{d.attempt}@w1".encode()
    await consumer.renew(MODEL, "w1", [Held(rec.id, d.entry_id, d.attempt)], hand_back_idle_ms=120_000)
    assert await _fenced(redis, keys, rec.id) is None
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 2, d.attempt)], "w1")).lost == [rec.id]
    assert await _logged(store, rec.id) == [1]


async def test_an_expiry_refuses_the_running_worker(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec, d = await _picked(store, consumer)
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 1, d.attempt)], "w1")).lost == []
    assert await store.expire(MODEL, rec.id, grace_ms=0, now=JobCancelled("deleted"))
    assert await _fenced(redis, keys, rec.id) is None  # the API's end, settled
    # Its log stays a stream (the API compacts nothing): only the fence keeps seq 3 out of it.
    assert (await consumer.flush(MODEL, [_tokens(rec.id, 3, d.attempt)], "w1")).lost == [rec.id]
    events = await store.read_events(MODEL, rec.id)
    assert [e.seq for e in events] == [1, 2] and isinstance(events[-1], Error)


async def test_a_job_leaves_its_shards_fence_with_its_end(redis, keys):
    store, consumer = JobStore(redis, keys, result_ttl_s=60), Consumer(redis, keys, result_ttl_s=60)
    rec, d = await _picked(store, consumer)
    builder = ResultBuilder()
    done = Done(seq=1, deltas=[TokenDelta(token_ids=[1], text="x", finish_reason="length")])
    builder.add(done)
    await consumer.flush(MODEL, [Outbound.of(rec.id, done, entry_id=d.entry_id, result=builder.result(),
                                             attempt=d.attempt)], "w1")
    assert (await store.get_job(MODEL, rec.id)).status == "done"
    assert await _fenced(redis, keys, rec.id) is None


async def test_a_follower_added_mid_stream_gets_the_next_flush(redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec, d = await _picked(store, consumer)
    channel = keys.relay(MODEL, "api-late", rec.id)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    await consumer.flush(MODEL, [_tokens(rec.id, 1, d.attempt)], "w1")
    assert await store.add_follower(MODEL, rec.id, channel)
    assert await _fenced(redis, keys, rec.id) == f"{d.attempt}@w1 {channel}".encode()
    await consumer.flush(MODEL, [_tokens(rec.id, 2, d.attempt)], "w1")
    lines = []
    for _ in range(30):
        message = await pubsub.get_message(timeout=0.05)
        if message is not None:
            lines += message["data"].split(b"\n")
    assert len(lines) == 1 and lines[0].startswith(f'{rec.id} {{"type":"tokens","seq":2'.encode())
    await pubsub.aclose()
