"""A finished job's event log is compacted (shared/eventlog.py, flush.lua) and still read back
exactly: real Redis, the real worker and API routes, a scripted engine.

While a job runs, its log is a stream, one entry per event; the script that writes its end
replaces the stream with one compact log, a field of the job's record, which costs a few hundred
bytes (often under 100) where the stream cost ~150 bytes a token. A late reader (``Last-Event-ID``,
``/events`` after the end) must not be able to tell: same events, same bytes, same sequence numbers.
"""

from __future__ import annotations

import asyncio

import pytest
from redis import Redis as SyncRedis

from shared import eventlog
from shared.codec import encode
from shared.events import Done, Error, TokenDelta, Tokens
from shared.keys import Keys
from shared.queue import Consumer, Flushed, JobStore, Outbound
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.bench.workload import prompts_for
from tests.support import inprocess_workers
from tests.support.event_log import finished_log, logged_events, read_job_sse
from tests.support.event_log import sse_frames as frames
from tests.support.inprocess_workers import MODEL, Client, assert_seamless, kill, running_on
from tests.support.scripted_engine import ScriptedEngine
from tests.support.waiting import eventually, job_status

make_worker = inprocess_workers.make_worker  # in-process workers with a ContextEngine, on real Redis


pytestmark = pytest.mark.stack(ScriptedEngine(delay_s=0.002), prefix="compaction")  # tests/integration/conftest.py


async def submit(stack, body: dict) -> str:
    resp = await stack.client.post("/v1/completions", json=body, headers={"Prefer": "respond-async"})
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


async def settled(redis, log_key: str) -> None:
    """Wait for a finished job's stream to go (settle.lua drops it just after the record took its
    compact log: the end is logged, then the record says it, then the shard is settled)."""
    async with asyncio.timeout(5):
        while await redis.exists(log_key):
            await asyncio.sleep(0.01)


async def job_keys(stack, job_id: str) -> list[bytes]:
    """Every key that names the job (its record, its log, anything else left behind)."""
    return [key async for key in stack.redis.scan_iter(match=f"{stack.settings.prefix}:*{job_id}*")]


@pytest.mark.parametrize("tokens", [64, 500])
@pytest.mark.parametrize("logprobs", [None, 2])
async def test_a_finished_job_costs_its_record_plus_well_under_1kb(stack, tokens, logprobs):
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": tokens}
    if logprobs is not None:
        body["logprobs"] = logprobs
    job_id = await submit(stack, body)
    assert (await job_status(stack.client, job_id, timeout_s=30))["status"] == "done"
    keys = Keys(stack.settings.prefix)
    record_key, log_key = keys.job(stack.settings.model_name, job_id), keys.events(stack.settings.model_name, job_id)
    await settled(stack.redis, log_key)
    # One key: the compact log is a field of the record (a key of its own costs ~200 bytes).
    assert await job_keys(stack, job_id) == [record_key.encode()] and not await stack.redis.exists(log_key)
    result, request, log = await stack.redis.hmget(record_key, "result", "request", "log")
    # SAMPLES 0: every field counted (the default samples 5 of a hash's fields and extrapolates).
    record_bytes = await stack.redis.memory_usage(record_key, samples=0)
    # The target: once ended, the job costs its result plus at most 1 KB (its request, its log,
    # its timestamps, the key). The stream the log replaced took ~150 bytes per token.
    assert len(log) <= 512, len(log)
    assert record_bytes - len(result) <= 1024, (record_bytes, len(result))
    assert 0 < await stack.redis.ttl(record_key) <= stack.settings.result_ttl_s
    print(f"{tokens} tokens, logprobs={logprobs}: record {record_bytes} B (result {len(result)} B, "
          f"request {len(request)} B, log {len(log)} B)")


async def test_finished_jobs_leave_one_key_each_within_their_result_plus_1kb(stack):
    """Jobs as a user sends them (streamed completions of ~24 words, 64 tokens): each leaves its
    record and nothing else, and the record costs its result plus less than 1 KB. used_memory adds
    ~170 bytes a key on top of MEMORY USAGE (the expiry table's entry, the tables' buckets, the
    allocator's headers): tests.bench.memory measures that, over 2,000 jobs."""
    keys, model = Keys(stack.settings.prefix), stack.settings.model_name
    before = {k async for k in stack.redis.scan_iter(match=f"{stack.settings.prefix}:*")}

    async def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200 and (await resp.aread()).rstrip().endswith(b"data: [DONE]")

    await asyncio.gather(*(one(p) for p in prompts_for(20, "keys")))
    new = {k async for k in stack.redis.scan_iter(match=f"{stack.settings.prefix}:*")} - before
    records = [k for k in new if k.startswith(keys.job(model, "").encode())]
    assert len(records) == 20 and new == set(records), sorted(new - set(records))
    for key in records:
        result = await stack.redis.hget(key, "result")
        assert await stack.redis.hget(key, "log") is not None  # its compact log
        assert await stack.redis.memory_usage(key, samples=0) - len(result) <= 1024 - 200


async def read_sse(stack, job_id: str, after: int | None = None) -> bytes:
    return await read_job_sse(stack.client, job_id, after)


@pytest.mark.parametrize("tokens", [64, 500])
async def test_a_resume_after_the_end_gets_the_live_streams_bytes_from_every_event(stack, tokens):
    job_id = await submit(stack, {"prompt": "resume me", "max_tokens": tokens, "logprobs": 1})
    live = frames(await read_sse(stack, job_id))  # followed while it runs: live messages
    keys = Keys(stack.settings.prefix)
    await settled(stack.redis, keys.events(stack.settings.model_name, job_id))  # compacted
    sync = SyncRedis.from_url(stack.settings.redis_url)  # the e2e suites' reader (tests/support/event_log.py)
    logged = logged_events(sync, keys, stack.settings.model_name, job_id)
    sync.close()
    # An event carries every token its step and the steps before it produced while the flusher
    # was busy (merged before the flush): seqs still 1..n, every token once.
    assert [seq for seq, _ in logged] == list(range(1, len(logged) + 1))
    assert sum(len(d.get("token_ids", [])) for _, e in logged for d in e.get("deltas", [])) == tokens
    assert len(live) == len(logged) and live[0].startswith(b"id: 1\n") and b'"type":"done"' in live[-1]
    # Every resume point that has an event after it. (One after the terminal event waits for
    # events that never come, compacted or not: the relay has nothing to end it with.)
    for after in range(0, len(live)):
        assert frames(await read_sse(stack, job_id, after)) == live[after:], after


async def test_a_job_cancelled_mid_stream_is_compacted_and_reads_back_exactly(stack):
    job_id = await submit(stack, {"prompt": "cancel me", "max_tokens": 2000})
    keys = Keys(stack.settings.prefix)
    log_key = keys.events(stack.settings.model_name, job_id)
    async with asyncio.timeout(10):
        while await stack.redis.type(log_key) != b"stream" or await stack.redis.xlen(log_key) < 20:
            await asyncio.sleep(0.01)
    entries = [fields[b"e"] for _, fields in await stack.redis.xrange(log_key)]  # what ran, so far
    assert (await stack.client.delete(f"/v1/jobs/{job_id}")).status_code == 200
    assert (await job_status(stack.client, job_id, timeout_s=30))["status"] == "cancelled"
    compact = await stack.redis.hget(keys.job(stack.settings.model_name, job_id), "log")
    assert compact[:1] == eventlog.SHAPE_WITH_BASE  # no result to refer to: it carries its own text
    events = await JobStore(stack.redis, keys).read_events(stack.settings.model_name, job_id)
    assert [encode(e) for e in events[:len(entries)]] == entries
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert isinstance(events[-1], Error) and events[-1].code == "cancelled"
    live = frames(await read_sse(stack, job_id))
    assert frames(await read_sse(stack, job_id, len(events) - 1)) == live[-1:]


async def test_a_retried_terminal_flush_leaves_the_compact_log_as_it_was(redis, keys):
    """A flush retried after a lost reply finds no stream and the compact log in the record: its
    events are skipped, as any event already logged is; nothing is written twice, and no stream
    is made again."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec = JobRecord(id="j1", model=MODEL, request=GenerationRequest(prompt="x", sampling=SamplingParams()))
    await store.enqueue(rec)
    tokens, done, result = finished_log(prompt_tokens=1)
    compact = eventlog.compact(encode([*tokens, done]), encode(result))
    batch = [*(Outbound.of("j1", e) for e in tokens),
             Outbound.of("j1", done, result=result, log=compact)]
    usage = await redis.hgetall(keys.usage(MODEL))
    assert await consumer.flush(MODEL, batch) == Flushed([], {})
    assert await redis.hget(keys.job(MODEL, "j1"), "log") == compact
    assert await redis.exists(keys.events(MODEL, "j1")) == 0
    metered = await redis.hgetall(keys.usage(MODEL))
    assert metered != usage
    assert await consumer.flush(MODEL, batch) == Flushed([], {})  # the retry
    assert await redis.hget(keys.job(MODEL, "j1"), "log") == compact
    assert await redis.exists(keys.events(MODEL, "j1")) == 0
    assert await redis.hgetall(keys.usage(MODEL)) == metered  # metered once
    assert await store.read_events(MODEL, "j1") == [*tokens, done]
    assert await store.read_events(MODEL, "j1", after_seq=2) == [tokens[2], done]
    assert await store.read_events(MODEL, "j1", after_seq=4) == []


async def test_an_event_after_a_gap_in_its_log_is_not_written(redis, keys):
    """Ids are seqs with none deleted, so a log's length is its top: an event whose log holds fewer
    than the events before it (a failover took the last ones back) is not written, nor its job's
    later events in the batch, and the flush says how many the log holds."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    rec = JobRecord(id="j2", model=MODEL, request=GenerationRequest(prompt="x", sampling=SamplingParams()))
    await store.enqueue(rec)
    tokens = [Tokens(seq=n, deltas=[TokenDelta(token_ids=[n])]) for n in (1, 2, 3)]
    assert await consumer.flush(MODEL, [Outbound.of("j2", e) for e in tokens[1:]]) == Flushed([], {"j2": 0})
    assert await redis.exists(keys.events(MODEL, "j2")) == 0
    assert await consumer.flush(MODEL, [Outbound.of("j2", e) for e in tokens]) == Flushed([], {})
    assert [e.seq for e in await store.read_events(MODEL, "j2")] == [1, 2, 3]


# What a failover does to a log whose last events its replica never received: the new primary holds
# the stream without them (its top id is the last one kept, so they can be written again).
TAKE_BACK = """
local keep = redis.call('XLEN', KEYS[1]) - tonumber(ARGV[1])
local entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', keep)
redis.call('DEL', KEYS[1])
for _, e in ipairs(entries) do redis.call('XADD', KEYS[1], e[1], unpack(e[2])) end
return keep
"""


async def test_events_a_failover_took_back_are_written_again_by_their_worker(make_worker, redis, keys):
    """The client had them live; the log must have them too, or a resume would skip them. The
    worker writes them again from its attempt's record before its next ones, so the log, and the
    compact log the job's end leaves, are whole."""
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("taken back", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=10)
    kept = await redis.eval(TAKE_BACK, 1, keys.events(MODEL, job_id), 3)
    events = await client.finish()
    assert_seamless(events, "taken back", 60)
    assert kept >= 7
    await settled(redis, keys.events(MODEL, job_id))  # compacted: the stream was whole
    assert [encode(e) for e in await a.queue.read_events(MODEL, job_id)] == [encode(e) for e in events]


@pytest.mark.faults
async def test_a_job_whose_whole_log_a_failover_took_back_still_continues_after_a_crash(make_worker, redis, keys):
    """The worker writes its attempt's first event again with the prompt's token ids it carried,
    so a successor after a later crash continues the job from the log (without them it could only
    fail it: WorkerLost, "its prompt tokens were not recorded")."""
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("taken back whole", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=5)
    log_key = keys.events(MODEL, job_id)
    await redis.delete(log_key)  # the new primary never received the stream

    async def refilled() -> bool:
        first = await redis.xrange(log_key, "-", "+", count=1)
        return bool(first) and await redis.xlen(log_key) >= 10

    await eventually(refilled, what="the log written again from seq 1")
    [(entry_id, fields)] = await redis.xrange(log_key, "-", "+", count=1)
    assert entry_id == b"1-0" and b"p" in fields, fields
    b = await make_worker(delay_s=0.002)
    await kill(a)
    events = await client.finish()
    assert_seamless(events, "taken back whole", 60)
    record = await b.queue.get_job(MODEL, job_id)
    assert (record.attempt, record.status) == (2, "done")


@pytest.mark.faults
async def test_a_crash_continued_job_keeps_its_stream_and_resumes_exactly(make_worker, redis, keys):
    """Attempt 2 wrote only the events after the crash, so it does not compact (the stream
    stays, as before): every resume still reads exactly what the client saw live."""
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    job_id = await client.start("crash me", 60)
    await running_on(a.queue, job_id, a.worker, min_tokens=10)
    b = await make_worker(delay_s=0.002)
    await kill(a)
    events = await client.finish()
    assert_seamless(events, "crash me", 60)
    assert (await b.queue.get_job(MODEL, job_id)).attempt == 2
    assert await redis.type(keys.events(MODEL, job_id)) == b"stream"
    for after in range(len(events) + 1):
        assert [encode(e) for e in await b.queue.read_events(MODEL, job_id, after)] == [encode(e) for e in
                                                                                       events[after:]]
    assert isinstance(events[-1], Done)


async def test_a_job_cancelled_before_it_started_leaves_its_one_event_as_plain_json(make_worker, redis, keys):
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    job_id = await inprocess_workers.submit(store, "never runs", 10)
    assert await store.cancel(MODEL, job_id) == "queued"
    await make_worker()
    async with asyncio.timeout(10):
        while (await store.get_job(MODEL, job_id)).status != "cancelled":
            await asyncio.sleep(0.02)
    [event] = await store.read_events(MODEL, job_id)
    assert isinstance(event, Error) and (event.seq, event.code) == (1, "cancelled")
    assert await redis.hget(keys.job(MODEL, job_id), "log") == eventlog.PLAIN + encode([event])
