"""Deadlines and priority levels: the real app on a real port, a scripted worker, real Redis.

A deadline is absolute (``queued_at`` + the request's timeout): a job still queued when it passes
never reaches the engine, a running one is aborted, and both end with ``deadline_exceeded``
(504). Priorities: one stream per level, read most urgent first.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from shared.codec import decode_event
from shared.events import Error
from shared.keys import GROUP, Keys
from shared.queue import JobStore, level_of
from tests.support.job_records import MODEL, record, wait_status
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually

BOUND_S = 5.0  # generous upper bound on "ended at its deadline"; the measured figure is recorded


async def occupy(s, tokens: int = 400) -> str:
    """Fill the only engine slot with a long job; returns its id once it runs."""
    resp = await s.client.post("/v1/jobs", json={"prompt": "busy", "sampling": {"max_tokens": tokens}})
    job_id = resp.json()["id"]
    await wait_status(s.redis, s.settings.prefix, job_id, {"running"})
    return job_id


def ran(engine: ScriptedEngine) -> list[str]:
    """The jobs that reached the engine, in order (without the worker's warm-up)."""
    return [j for j in engine.started if not j.startswith("warmup-")]


async def log_events(s, job_id: str) -> list:
    return await JobStore(s.redis, Keys(s.settings.prefix)).read_events(MODEL, job_id)


async def queue_drained(s, timeout: float = 20) -> None:
    """Every level's stream and pending list empty: no entry outlived its job."""
    keys = Keys(s.settings.prefix)

    async def drained() -> bool:
        lengths = [await s.redis.xlen(q) for q in keys.queues(MODEL)]
        pending = [(await s.redis.xpending(q, GROUP))["pending"] for q in keys.queues(MODEL)]
        return not any(lengths) and not any(pending)
    await eventually(drained, timeout_s=timeout, what="every level's stream and pending list empty")


# --- deadlines ---------------------------------------------------------------------------------


@pytest.mark.faults
async def test_a_job_whose_deadline_passes_in_the_queue_never_reaches_the_engine(redis_url, prefix, figures):
    engine = ScriptedEngine(delay_s=0.01)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1) as s:
        busy = await occupy(s, tokens=150)
        # Fire-and-poll with nobody following: only the worker can end it, when it reads it.
        polled = await s.client.post("/v1/jobs", json={"prompt": "late", "timeout_s": 0.3})
        # A waiting client (X-LLMQ-Timeout): the API ends the job at the deadline, not the worker.
        t0 = time.monotonic()
        resp = await s.client.post("/v1/completions", json={"prompt": "late", "max_tokens": 4},
                                   headers={"X-LLMQ-Timeout": "0.5"})
        waited = time.monotonic() - t0
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["message"] == "the request's deadline passed before it finished"
        assert 0.4 < waited < BOUND_S
        # TGI's shape for the same (a stream: the error is its one event after the 200).
        tgi = await s.client.post("/generate_stream", json={"inputs": "late", "parameters": {"max_new_tokens": 2}},
                                  headers={"X-LLMQ-Timeout": "0.2"})
        assert json.loads(tgi.content.removeprefix(b"data:"))["error_type"] == "deadline_exceeded"

        rec = await wait_status(s.redis, prefix, polled.json()["id"], {"failed"})
        assert rec.error is not None and (rec.error.code, rec.error.status) == ("deadline_exceeded", 504)
        assert rec.started_at is None  # it never ran
        events = await log_events(s, rec.id)
        assert len(events) == 1 and isinstance(events[0], Error) and events[0].seq == 1
        assert ran(engine) == [busy]  # none of the expired jobs reached the engine
        await queue_drained(s)  # and their entries were acked and deleted when read
        assert (await record(s.redis, prefix, busy)).status == "done"
    figures.requests_sent, figures.ended_with_error, figures.completed = 4, 3, 1
    figures.seconds["sync_wait_s"] = waited


@pytest.mark.faults
async def test_a_running_job_is_aborted_at_its_deadline_and_its_slot_freed(redis_url, prefix, figures):
    engine = ScriptedEngine(delay_s=0.02)
    # The default deadline (LLMQ_DEADLINE_S) applies to every request that sets none.
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1, deadline_s=0.6) as s:
        t0 = time.monotonic()
        async with s.client.stream("POST", "/v1/completions",
                                   json={"prompt": "slow", "max_tokens": 1000, "stream": True}) as resp:
            assert resp.status_code == 200
            raw = await resp.aread()
        ended = time.monotonic() - t0
        frames = [f for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
        texts = [json.loads(f.removeprefix(b"data: ")).get("choices", [{}])[0].get("text", "") for f in frames[:-1]]
        assert 5 < len("".join(texts)) < 1000  # tokens flowed, then the deadline cut it short
        error = json.loads(frames[-1].removeprefix(b"data: "))["error"]
        assert error["message"] == "the request's deadline passed while it was running"
        assert raw.endswith(b"data: [DONE]\n\n")
        assert 0.5 < ended < BOUND_S
        job_id = ran(engine)[0]
        assert engine.aborted == [job_id]
        rec = await record(s.redis, prefix, job_id)
        assert rec.status == "failed" and rec.error.code == "deadline_exceeded"
        assert rec.deadline == pytest.approx(rec.queued_at + 600)
        # The slot is free: the next request runs, and the engine's log (not a clock: the next
        # request's own deadline is set far off, so load cannot end it first) shows in what order.
        # The only slot held the aborted job until it left the engine; the next started after.
        resp = await s.client.post("/v1/completions", json={"prompt": "next", "max_tokens": 3},
                                   headers={"X-LLMQ-Timeout": "20"})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "nex"
        next_id = ran(engine)[1]
        log = [e for e in engine.log if not e[1].startswith("warmup-")]
        assert log[0] == ("start", job_id) and sorted(log[1:3]) == [("abort", job_id), ("end", job_id)], log
        assert log[3:] == [("start", next_id), ("end", next_id)], log
        await queue_drained(s)
    figures.requests_sent, figures.ended_with_error, figures.completed = 2, 1, 1
    figures.seconds["aborted_after_s"] = ended


async def test_a_worker_that_cannot_end_an_overdue_job_is_fenced_off_by_the_api(redis_url, prefix):
    """The backstop: the worker's own timer never fires (a stalled loop); past the deadline plus
    a grace the API ends the job for the waiting client, and the worker's late writes are refused."""
    engine = ScriptedEngine(delay_s=0.02)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1) as s:
        accept = s.worker._accept

        async def without_timer(delivery, slots, *claim):
            delivery.deadline = None  # the worker never learns the deadline: its timer cannot fire
            await accept(delivery, slots, *claim)

        s.worker._accept = without_timer  # type: ignore[method-assign]
        resp = await s.client.post("/v1/jobs/", json={"prompt": "stuck", "sampling": {"max_tokens": 400}},
                                   headers={"X-LLMQ-Timeout": "0.5"})
        assert resp.status_code == 202
        job_id = resp.json()["id"]
        events = []
        async with s.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(decode_event(line.removeprefix("data: ")))
        assert isinstance(events[-1], Error) and events[-1].code == "deadline_exceeded"
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # one ordered log, no gap
        rec = await record(s.redis, prefix, job_id)
        assert rec.status == "failed" and rec.worker == ""
        async with asyncio.timeout(BOUND_S):  # its next write is refused: the worker lets go of it
            while job_id not in engine.aborted:
                await asyncio.sleep(0.02)
        await queue_drained(s, timeout=30)  # the stale entry is reclaimed, found finished, deleted


@pytest.mark.parametrize(("headers", "param"), [
    ({"X-LLMQ-Timeout": "soon"}, "X-LLMQ-Timeout"),
    ({"X-LLMQ-Timeout": "0"}, None),
    ({"X-LLMQ-Timeout": "-3"}, None),
    ({"X-LLMQ-Priority": "high"}, "X-LLMQ-Priority"),
])
async def test_bad_option_headers_get_the_dialects_400(redis_url, prefix, headers, param):
    async with scripted_stack(redis_url, prefix) as s:
        resp = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert resp.status_code == 400, resp.text
        body = resp.json()["error"]
        assert body["type"] == "BadRequestError" and body["param"] == param
        resp = await s.client.post("/generate", json={"inputs": "x"}, headers=headers)
        assert resp.status_code == 422 and resp.json()["error_type"] == "validation"


# --- priorities --------------------------------------------------------------------------------


def test_priorities_map_to_three_levels():
    assert [level_of(p) for p in (-5, 0, 1, 2, 3, 100)] == [0, 0, 1, 2, 2, 2]


async def test_queued_jobs_start_most_urgent_level_first(redis_url, prefix):
    engine = ScriptedEngine(delay_s=0.01)
    keys = Keys(prefix)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1) as s:
        busy = await occupy(s, tokens=100)
        submitted: dict[str, str] = {}
        for name, priority, header in [("low-a", 2, None), ("low-b", 9, None), ("mid", 1, None),
                                       ("high-a", 0, None), ("urgent", -1, None), ("high-b", None, "0"),
                                       ("mid-header", None, "1")]:
            body: dict = {"prompt": name, "sampling": {"max_tokens": 2}}
            if priority is not None:
                body["priority"] = priority
            resp = await s.client.post("/v1/jobs", json=body, headers={"X-LLMQ-Priority": header} if header else {})
            submitted[resp.json()["id"]] = name
        # While the slot is taken every job waits on its level's waiting stream (the running one
        # is in the level's queue stream).
        assert [await s.redis.xlen(q) for q in keys.waitings(MODEL)] == [3, 2, 2]
        assert [await s.redis.xlen(q) for q in keys.queues(MODEL)] == [1, 0, 0]
        for job_id in submitted:
            await wait_status(s.redis, prefix, job_id, {"done"})
    order = [submitted[j] for j in ran(engine) if j != busy]
    # Level 0 in arrival order, then level 1, then level 2: the level is what orders the queue.
    # (Within a level the engine, not the queue, orders by the priority value itself.)
    assert order == ["high-a", "urgent", "high-b", "mid", "mid-header", "low-a", "low-b"]


@pytest.mark.parametrize("body_priority, header, stored", [
    (0, "2", 0),  # an explicit 0 in the body is a choice: the header does not override it
    (None, "2", 2),  # no body field: the header's
    (1, None, 1),
    (None, None, 0),
])
async def test_a_body_priority_wins_over_the_header_even_when_it_is_0(redis_url, prefix, body_priority, header, stored):
    async with scripted_stack(redis_url, prefix) as s:
        body: dict = {"prompt": "p", "max_tokens": 1}
        if body_priority is not None:
            body["priority"] = body_priority
        headers = {"Prefer": "respond-async", **({"X-LLMQ-Priority": header} if header else {})}
        resp = await s.client.post("/v1/completions", json=body, headers=headers)
        assert resp.status_code == 202, resp.text
        rec = await record(s.redis, s.settings.prefix, resp.json()["id"])
        assert rec is not None and rec.request.priority == stored


async def test_the_depth_limit_counts_every_level_and_holds_under_concurrency(redis_url, prefix):
    engine = ScriptedEngine(delay_s=0.02)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1, max_queued=5) as s:
        await occupy(s, tokens=200)

        async def submit(i: int) -> int:
            body = {"prompt": f"j{i}", "priority": i % 3, "sampling": {"max_tokens": 2}}
            return (await s.client.post("/v1/jobs", json=body)).status_code

        statuses = await asyncio.gather(*(submit(i) for i in range(20)))
        # One running + four queued = the limit of five unfinished jobs, whatever their levels;
        # the check and the enqueue are one script, so concurrent submitters never overshoot.
        assert sorted(statuses) == [202] * 4 + [429] * 16
        assert await JobStore(s.redis, Keys(prefix)).depth(MODEL) == 5


async def test_service_tier_through_the_openai_sdk_queues_on_its_level_and_is_reported(redis_url, prefix):
    from openai import AsyncOpenAI

    async with scripted_stack(redis_url, prefix) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "p"}], max_tokens=2, service_tier="flex")
        assert chat.service_tier == "flex"
        rec = await record(s.redis, s.settings.prefix, chat.id.removeprefix("chatcmpl-"))
        assert rec is not None and rec.request.priority == 2 and level_of(rec.request.priority) == 2
        plain = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "p"}],
                                                     max_tokens=2)
        assert plain.service_tier is None  # none named: none reported, as before
        auto = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "p"}],
                                                    max_tokens=2, service_tier="auto")
        assert auto.service_tier == "default"
        done = await client.completions.create(model=MODEL, prompt="p", max_tokens=2,
                                               extra_body={"service_tier": "flex"})
        rec = await record(s.redis, s.settings.prefix, done.id.removeprefix("cmpl-"))
        assert rec is not None and rec.request.priority == 2
