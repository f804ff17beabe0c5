"""Relay channels: one PUBLISH per API process per flush carries every job it follows.

A job's record names the relay channel of each API process following it (``relay``), one channel
per token shard of the model (the job's shard's); flush.lua publishes one message per such channel
per batch, a line ``<job id> <event JSON>`` per event, and
the API's listener splits it back out by job id. These tests pin those bytes, the fallback to a
job's own live channel, a second API process joining a running job, and the RESYNC after a lost
pub/sub connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import httpx
import pytest
from redis.asyncio import Redis

from api.follow import Lane, follow
from api.listener import EventListener
from shared.codec import encode
from shared.events import Done, TokenDelta, Tokens
from shared.framing import Keepalive
from shared.keys import Keys, shard_of, shard_tag
from shared.queue import Consumer, Flushed, JobStore, Outbound, now_ms
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_settings, scripted_stack, serve_api

MODEL = "tiny"


class Relayed(NamedTuple):
    redis: Redis
    keys: Keys
    queue: JobStore
    listener: EventListener
    channel: Callable[[str], str]
    """This API process's relay channel for a job of MODEL (its token shard's)."""


@pytest.fixture
async def relayed(redis_url: str, prefix: str) -> AsyncIterator[Relayed]:
    """A running listener (API process ``t``) on real Redis, and the queue beside it."""
    redis = connect(redis_url)
    keys = Keys(prefix)
    listener = EventListener(redis, keys.api_home("t"))
    runner = asyncio.create_task(listener.run())
    try:
        yield Relayed(redis, keys, JobStore(redis, keys), listener, lambda job_id: keys.relay(MODEL, "t", job_id))
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await redis.aclose()


def _record(job_id: str) -> JobRecord:
    return JobRecord(id=job_id, model=MODEL, request=GenerationRequest(model=MODEL, prompt="abc"), queued_at=now_ms())


async def _messages(pubsub, n: int) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    async with asyncio.timeout(5):
        while len(out) < n:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if msg is not None:
                out.append((msg["channel"], msg["data"]))
    return out


def _one_shard(n: int) -> list[str]:
    """``n`` job ids in one token shard (a relay channel carries one shard's jobs)."""
    ids = [f"j{i}" for i in range(1000)]
    return [j for j in ids if shard_of(j) == shard_of(ids[0])][:n]


async def test_one_publish_per_relay_channel_per_flush_with_exact_lines(redis_url, prefix):
    redis = connect(redis_url)
    keys = Keys(prefix)
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    j1, j2, j3 = _one_shard(3)
    a, b = keys.relay(MODEL, "a", j1), keys.relay(MODEL, "b", j1)
    try:
        await consumer.ensure_group(MODEL)
        await store.enqueue(_record(j1), relay=a)
        await store.enqueue(_record(j2), relay=a)
        await store.enqueue(_record(j3))  # queued without a follower (fire-and-poll)
        assert await store.add_follower(MODEL, j2, b)
        assert await store.add_follower(MODEL, j2, b)  # named once, however often it is asked
        assert not await store.add_follower(MODEL, "missing", b)  # no record: nothing is written
        assert await redis.hget(keys.job(MODEL, j2), "relay") == f"{a} {b}".encode()
        assert not await redis.exists(keys.job(MODEL, "missing"))
        attempts = {d.job_id: d.attempt for d in (await consumer.pick(MODEL, "w", 3)).deliveries}

        pubsub = redis.pubsub()
        await pubsub.subscribe(a, b, keys.live(MODEL, j1), keys.live(MODEL, j2), keys.live(MODEL, j3))
        batch = [Outbound.of(j, Tokens(seq=s, deltas=[TokenDelta(token_ids=[96 + s], text=chr(96 + s))]),
                             attempt=attempts[j])
                 for s in (1, 2) for j in (j1, j2, j3)]
        assert await consumer.flush(MODEL, batch, "w") == Flushed([], {})
        line = {(o.job_id, o.seq): o.job_id.encode() + b" " + o.data for o in batch}
        got = await _messages(pubsub, 4)
        # Relay channels in the order their first event appeared, after the per-job publishes made
        # while the batch was written; each one message, its events in batch order.
        assert sorted(got) == sorted([
            (keys.live(MODEL, j3).encode(), batch[2].data),
            (keys.live(MODEL, j3).encode(), batch[5].data),
            (a.encode(), b"\n".join([line[j1, 1], line[j2, 1], line[j1, 2], line[j2, 2]])),
            (b.encode(), b"\n".join([line[j2, 1], line[j2, 2]])),
        ])
        assert [c for c, _ in got][-2:] == [a.encode(), b.encode()]
        assert await _nothing_more(pubsub)
        await pubsub.aclose()
    finally:
        await redis.aclose()


async def test_on_a_single_redis_one_publish_carries_every_shards_jobs_for_an_api(redis_url, prefix):
    """A single Redis flushes every token shard in one call, so the API's one relay channel per
    model (Keys.relay, not sharded) gets one message per flush for jobs of different shards."""
    redis = connect(redis_url)
    keys = Keys(prefix)
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    jobs = [f"j{i}" for i in range(200)]
    jobs = [next(j for j in jobs if shard_of(j) == s) for s in range(3)]  # three shards
    channel = keys.relay(MODEL, "a", jobs[0], sharded=False)
    assert {keys.relay(MODEL, "a", j, sharded=False) for j in jobs} == {channel}
    try:
        await consumer.ensure_group(MODEL)
        for job in jobs:
            await store.enqueue(_record(job), relay=channel)
        attempts = {d.job_id: d.attempt for d in (await consumer.pick(MODEL, "w", 3)).deliveries}
        pubsub = redis.pubsub()
        await pubsub.subscribe(channel)
        batch = [Outbound.of(j, Tokens(seq=1, deltas=[TokenDelta(token_ids=[97], text="a")]), attempt=attempts[j])
                 for j in jobs]
        assert await consumer.flush(MODEL, batch, "w") == Flushed([], {})
        assert await _messages(pubsub, 1) == [(channel.encode(), b"\n".join(o.job_id.encode() + b" " + o.data
                                                                          for o in batch))]
        assert await _nothing_more(pubsub)
        await pubsub.aclose()
    finally:
        await redis.aclose()


async def _nothing_more(pubsub) -> bool:
    for _ in range(3):  # a confirmation is skipped (None) like silence: look a few times
        if await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1) is not None:
            return False
    return True


async def test_listener_splits_a_relay_message_by_job_and_resyncs_after_a_lost_connection(relayed):
    """The relay twin of test_relay_faults' kill window: messages published while the pub/sub
    connection is down are gone; the re-subscription must make every job's follower on that
    channel read its log at once."""
    redis, keys, queue, listener, relay_channel = relayed
    x, y, nobody = _one_shard(3)
    channel = relay_channel(x)
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[97], text="a")]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[98], text="b", finish_reason="length")])]

    def log_and_publish(pipe, event, jobs) -> None:
        for job in jobs:
            pipe.xadd(keys.events(MODEL, job), {"e": encode(event)}, id=f"{event.seq}-0")
        pipe.publish(channel, b"\n".join(job.encode() + b" " + encode(event) for job in jobs))

    async with listener.follow(channel, x) as live_x, listener.follow(channel, y) as live_y:
        assert listener.channels == 2
        streams = [follow(queue, live, MODEL, job, check_log_s=30.0)
                   for live, job in ((live_x, x), (live_y, y))]
        pipe = redis.pipeline(transaction=True)
        log_and_publish(pipe, events[0], [x, y, nobody])
        await pipe.execute()
        first = [await asyncio.wait_for(anext(s), 5) for s in streams]
        assert [e.seq for e in first] == [1, 1]
        pipe = redis.pipeline(transaction=True)
        pipe.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        log_and_publish(pipe, events[1], [x, y])
        replies = await pipe.execute()
        assert replies[0] >= 1 and replies[-1] == 0, replies  # killed; nobody heard seq 2
        started = time.monotonic()
        last = [await asyncio.wait_for(anext(s), 5) for s in streams]
        assert time.monotonic() - started < 5, "the lost events waited for the periodic log check"
        assert last == [events[1], events[1]]
    assert listener.channels == 0  # the channel stays subscribed; no job is followed on it


async def test_streams_use_relay_channels_and_a_second_api_joins_a_running_job(redis_url, prefix):
    """Through the real routes: no per-job live channel carries anything, and a second API
    process resuming a running job's events is added to its record and gets every event."""
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.02)) as s:
        watcher = s.redis.pubsub()
        await watcher.psubscribe(f"{prefix}:*")
        async with serve_api(scripted_settings(redis_url, prefix)) as other_url, \
                httpx.AsyncClient(base_url=other_url, timeout=30) as other:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 30, "stream": True}
            async with s.client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                data = [line async for line in _data_lines(lines, stop_after=1)]
                job_id = json.loads(data[0])["id"].removeprefix("cmpl-")
                async with other.stream("GET", f"/v1/jobs/{job_id}/events") as resumed:
                    assert resumed.status_code == 200
                    relay = (await s.redis.hget(Keys(prefix).job(MODEL, job_id), "relay")).decode().split()
                    assert len(relay) == 2 and len(set(relay)) == 2, relay
                    # A single Redis: the model's one relay channel per API process (Keys.relay)
                    model_wide = f"{prefix}:{{{shard_tag(MODEL, 0)}}}:relay:"
                    assert all(c.startswith(model_wide) for c in relay), relay
                    data += [line async for line in _data_lines(lines)]
                    replay = (await resumed.aread()).decode()
        text = "".join(json.loads(x)["choices"][0]["text"] for x in data if x != "[DONE]")
        assert text == expected_text("hello there", 30) and data[-1] == "[DONE]"
        seqs = [int(x[4:]) for x in replay.splitlines() if x.startswith("id: ")]
        # Every event (the last one final; one per step unless the flusher lagged), then [DONE].
        assert seqs == list(range(1, len(seqs) + 1)) and len(data) == len(seqs) + 1
        kinds = set()
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.3:  # what was published, until it goes quiet
            if (msg := await watcher.get_message(ignore_subscribe_messages=True, timeout=0.1)) is not None:
                kinds.add(msg["channel"].decode().removeprefix(f"{prefix}:").split(":")[1])
                quiet_since = time.monotonic()
        assert "relay" in kinds and "live" not in kinds, kinds
        await watcher.aclose()


async def _data_lines(lines: AsyncIterator[str], stop_after: int | None = None) -> AsyncIterator[str]:
    """The payloads of SSE ``data:`` lines from a response's line iterator (call again to go on)."""
    n = 0
    async for line in lines:
        if line.startswith("data: "):
            yield line[6:]
            n += 1
            if n == stop_after:
                return


async def test_a_job_followed_from_before_it_existed_never_reads_its_log(redis_url, prefix, monkeypatch):
    """Once the process's relay channel is subscribed, a new job's every event comes live: the
    stream must not also read the job's log (that was a round trip plus a decode of each event
    already on its way). The first job of the model may have to (its SUBSCRIBE was in flight)."""
    reads: list[str] = []
    original = JobStore.read_events

    async def counting(self, model, job_id, after_seq=0):
        reads.append(job_id)
        return await original(self, model, job_id, after_seq)

    monkeypatch.setattr(JobStore, "read_events", counting)
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.001)) as s:
        body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 6, "stream": True}
        for _ in range(2):  # the first one subscribes the channel
            resp = await s.client.post("/v1/completions", json=body)
            assert resp.status_code == 200
        reads.clear()
        for _ in range(3):
            resp = await s.client.post("/v1/completions", json=body)
            text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in resp.text.splitlines()
                           if x.startswith("data: {"))
            assert text == expected_text("abcdef", 6)
        assert reads == []


async def test_a_finished_job_resumed_after_its_last_event_ends_at_once(redis_url, prefix):
    """A client that already has a finished job's last event reconnects with its id: the stream
    is empty and ends (it used to wait for events that would never come)."""
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.001)) as s:
        resp = await s.client.post("/v1/jobs", json={"model": MODEL, "prompt": "abc", "sampling": {"max_tokens": 3}})
        assert resp.status_code in (200, 202), resp.text
        job_id = resp.json()["id"]
        async with asyncio.timeout(10):
            while (await s.client.get(f"/v1/jobs/{job_id}")).json()["status"] != "done":
                await asyncio.sleep(0.05)
        whole = (await s.client.get(f"/v1/jobs/{job_id}/events")).text
        seqs = [int(x[4:]) for x in whole.splitlines() if x.startswith("id: ")]
        assert seqs == [1, 2, 3], whole  # the last token rides the final event
        async with asyncio.timeout(5):
            tail = await s.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "2"})
            rest = await s.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "3"})
        assert tail.text == whole[whole.index("id: 3"):]
        assert rest.status_code == 200 and rest.text == ""


async def test_events_in_sequence_go_out_in_the_listeners_step_and_the_rest_through_follow(relayed):
    """While a stream's consumer takes events through its lane, the listener hands it each next
    event in sequence without waking the follower's task; a duplicate is dropped there; a gap,
    an event the consumer declines (its client not keeping up) and the terminal event reach
    follow, which fills the gap from the log and goes on from the lane's last seq. Every event
    reaches the client exactly once, in order."""
    redis, keys, queue, listener, relay_channel = relayed
    channel = relay_channel("x")
    tokens = {s: Tokens(seq=s, deltas=[TokenDelta(token_ids=[96 + s], text=chr(96 + s))]) for s in range(1, 9)}
    done = Done(seq=9, deltas=[TokenDelta(token_ids=[105], text="i", finish_reason="length")])
    delivered: list[int] = []
    keeping_up = True

    def deliver(event) -> bool:
        if keeping_up:
            delivered.append(event.seq)
        return keeping_up

    async def publish(*events, log_only=(), again=()) -> None:
        pipe = redis.pipeline(transaction=True)
        for event in (*log_only, *events):
            pipe.xadd(keys.events(MODEL, "x"), {"e": encode(event)}, id=f"{event.seq}-0")
        if events:
            pipe.publish(channel, b"\n".join(b"x " + encode(e) for e in (*events, *again)))
        await pipe.execute()

    async def until_delivered(n: int) -> None:
        async with asyncio.timeout(5):
            while len(delivered) < n:
                await asyncio.sleep(0.01)

    async with listener.follow(channel, "x") as live:
        lane = Lane()
        lane.deliver = deliver
        events = follow(queue, live, MODEL, "x", check_log_s=30.0, lane=lane)
        step = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)  # parked: waiting for a live message
        await publish(tokens[1], tokens[2], tokens[3], again=[tokens[2]])
        await until_delivered(3)
        await asyncio.sleep(0.05)
        assert delivered == [1, 2, 3] and not step.done()  # nothing woke the follower
        await publish(tokens[5], log_only=[tokens[4]])  # 4 is lost on the way: a gap
        async with asyncio.timeout(5):
            assert await step == tokens[4]
            assert await anext(events) == tokens[5]
        step = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        await publish(tokens[6])
        await until_delivered(4)
        keeping_up = False
        await publish(tokens[7])  # declined: follow renders it
        async with asyncio.timeout(5):
            assert await step == tokens[7]
        keeping_up = True
        step = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        await publish(tokens[8], done)  # the end always goes through follow
        async with asyncio.timeout(5):
            assert await step == done
        assert delivered == [1, 2, 3, 6, 8]
        with pytest.raises(StopAsyncIteration):
            await anext(events)


async def test_a_stream_fed_through_its_lane_gets_a_keepalive_only_after_a_quiet_stretch(relayed):
    """Events that go out through the lane count as activity: no keep-alive while they flow,
    one once the stream has been quiet for keepalive_s since the last of them."""
    redis, keys, queue, listener, relay_channel = relayed
    channel = relay_channel("k")
    delivered: list[float] = []
    loop = asyncio.get_running_loop()
    async with listener.follow(channel, "k") as live:
        lane = Lane()
        lane.deliver = lambda event: delivered.append(loop.time()) is None
        events = follow(queue, live, MODEL, "k", check_log_s=30.0, keepalive_s=0.3, lane=lane)
        step = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        for seq in range(1, 9):  # 0.8 s of events, 0.1 s apart: never quiet for 0.3 s
            event = Tokens(seq=seq, deltas=[TokenDelta(token_ids=[97], text="a")])
            await redis.publish(channel, b"k " + encode(event))
            await asyncio.sleep(0.1)
        assert len(delivered) == 8 and not step.done()
        async with asyncio.timeout(5):
            assert isinstance(await step, Keepalive)
        quiet = loop.time() - delivered[-1]
        assert 0.3 <= quiet < 0.45, quiet
        await events.aclose()
