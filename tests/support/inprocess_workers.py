"""In-process workers on real Redis, and a client that follows a job as the API does: the
helpers of the reclaim, continuation and takeover suites (tests/integration/test_reclaim.py,
test_continuation.py, test_fast_takeover.py, test_takeover_cluster.py).

A test module uses the fixture by binding it: ``make_worker = inprocess_workers.make_worker``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest

from api.follow import follow
from shared.config import load_settings
from shared.events import Done, Event, Tokens
from shared.keys import Keys
from shared.queue import Consumer, JobStore, now_ms
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.support.scripted_engine import ContextEngine, expected_ids
from tests.support.waiting import eventually
from workers.runner import Worker

MODEL = "m"
TAKEOVER_S = 0.5  # LLMQ_TAKEOVER_S's default


@dataclass
class Running:
    worker: Worker
    queue: JobStore
    """The API's side, for the test (the worker reads through its own :class:`Consumer`)."""
    task: asyncio.Task


@pytest.fixture
async def make_worker(redis, prefix):
    started: list[Running] = []

    async def start(delay_s: float = 0.01, die_after: int | None = None, engine=None, tracing=None,
                    **overrides) -> Running:
        settings = load_settings({}, prefix=prefix, served_model_name=MODEL, heartbeat_s=0.2,
                                 **{"lease_s": 1.0, "block_ms": 100, **overrides})
        queue = JobStore(redis, Keys(prefix))
        worker = Worker(settings, Consumer(redis, Keys(prefix)), engine or ContextEngine(delay_s, die_after),
                        tracing=tracing)
        task = asyncio.create_task(worker.run())
        started.append(Running(worker, queue, task))
        await eventually(lambda: worker.ready, timeout_s=120, interval_s=0.01, what="the worker to be warm")
        await asyncio.sleep(0.3)  # one heartbeat: registered as ready, so peers see it
        return started[-1]

    yield start
    for r in started:
        if not r.task.done():
            r.worker.stop()
            # asyncio.wait, not wait_for: on Python 3.11 wait_for's timeout waits for the
            # cancelled task to finish, so a task stuck in its clean-up would hang the session.
            await asyncio.wait([r.task], timeout=20)


async def kill(r: Running) -> None:
    """What SIGKILL does to a worker, in process: every task stops, nothing is cleaned up (no final
    flush, no unregister, no ack); its heartbeat key and leases simply lapse. Returns once every
    task of the worker is gone, so no write of it can land after this (a real kill is instant)."""
    jobs = [running.task for running in r.worker._running.values()]
    for task in (*jobs, r.task):
        task.cancel()
    done, _ = await asyncio.wait(jobs, timeout=10) if jobs else (set(), set())
    assert len(done) == len(jobs) and not r.worker._running, "a job task outlived its worker"
    # The worker's own task must be gone too, or its reader lives on and reclaims the very job
    # this kill left behind (seen once in CI). One cancel is not always enough: redis-py sends
    # every command through asyncio.wait_for, which on Python 3.11 can drop a cancel that arrives
    # just as the send completes (fixed in 3.12). So cancel again until the task is done, and its
    # task group's children with it: the group cancels them once, and a child that dropped that
    # cancel (its heartbeat, control or reader loop) would keep the group, and the task, waiting
    # for good (seen once in CI).
    deadline = asyncio.get_running_loop().time() + 10
    while not r.task.done() and asyncio.get_running_loop().time() < deadline:
        for task in (r.task, *_children(r.worker)):
            task.cancel()
        await asyncio.wait([r.task], timeout=0.1)
    assert r.task.done(), "the killed worker's task would not stop"


def _children(worker: Worker) -> list[asyncio.Task]:
    """The tasks running one of ``worker``'s (or its presence's, or its outbox's) loops: the outbox's
    flusher is a child of the worker's task group too, and one that dropped its cancel kept the
    group waiting (seen once in CI)."""
    owners = (worker, worker.presence, worker.outbox)
    found = []
    for task in asyncio.all_tasks():
        frame = getattr(task.get_coro(), "cr_frame", None)
        if frame is not None and any(frame.f_locals.get("self") is owner for owner in owners):
            found.append(task)
    return found


async def submit(queue: JobStore, prompt: str, max_tokens: int, **sampling) -> str:
    rec = JobRecord(id=uuid.uuid4().hex, model=MODEL, queued_at=now_ms(), request=GenerationRequest(
        prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, **sampling)))
    return await queue.enqueue(rec)


class Client:
    """A streaming client as the API serves it: subscribed before the job is queued, then
    relayed by ``follow`` (live messages first, gaps filled from the event log by seq)."""

    def __init__(self, redis, queue: JobStore) -> None:
        self.redis, self.queue = redis, queue
        self.events: list[Event] = []

    async def start(self, prompt: str, max_tokens: int, traceparent: str | None = None, *, tenant: str = "",
                    priority: int | None = None, timeout_s: float | None = None, test_fault: str | None = None,
                    **sampling) -> str:
        self.job_id = uuid.uuid4().hex
        live: asyncio.Queue[bytes] = asyncio.Queue()
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.queue.keys.live(MODEL, self.job_id))

        async def pump() -> None:
            async for message in pubsub.listen():
                if message["type"] == "message":
                    live.put_nowait(message["data"])

        async def relay() -> None:
            pumping = asyncio.create_task(pump())
            try:
                async for event in follow(self.queue, live, MODEL, self.job_id, check_log_s=0.5):
                    self.events.append(event)
            finally:
                pumping.cancel()
                await pubsub.aclose()

        self.task = asyncio.create_task(relay())
        queued_at = now_ms()
        rec = JobRecord(id=self.job_id, model=MODEL, queued_at=queued_at,
                        deadline=queued_at + timeout_s * 1000 if timeout_s else None, request=GenerationRequest(
            prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, **sampling), priority=priority,
            test_fault=test_fault),
            traceparent=traceparent, tenant=tenant)
        await self.queue.enqueue(rec)
        return self.job_id

    async def finish(self, timeout: float = 20) -> list[Event]:
        await asyncio.wait_for(self.task, timeout)
        return self.events

    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, (Tokens, Done)) for d in e.deltas for t in d.token_ids]


async def wait_for(check, timeout: float = 10, every: float = 0.01):
    """:func:`tests.support.waiting.eventually` with these suites' finer default interval."""
    return await eventually(check, timeout_s=timeout, interval_s=every)


async def running_on(queue: JobStore, job_id: str, worker: Worker, min_tokens: int = 1) -> None:
    async def check() -> bool:
        job = await queue.get_job(MODEL, job_id)
        logged = len(await queue.read_events(MODEL, job_id))
        return job is not None and job.worker == worker.worker_id and logged >= min_tokens
    await wait_for(check)


def assert_seamless(events: list[Event], prompt: str, max_tokens: int) -> None:
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "seqs contiguous, each once"
    assert isinstance(events[-1], Done)
    ids = [t for e in events if isinstance(e, (Tokens, Done)) for d in e.deltas for t in d.token_ids]
    assert ids == expected_ids(prompt, max_tokens), "no token lost or repeated; identical to one run"
    text = "".join(d.text for e in events if isinstance(e, (Tokens, Done)) for d in e.deltas)
    assert text == "".join(map(chr, expected_ids(prompt, max_tokens)))
    assert events[-1].usage.completion_tokens == max_tokens
    assert events[-1].usage.prompt_tokens == len(prompt)


# --- takeover ------------------------------------------------------------------------------

async def judging(worker: Worker) -> None:
    """Until the worker's watcher judges peers (its own subscription up for long enough)."""
    await eventually(lambda: asyncio.get_running_loop().time() >= worker.presence.watch_from, timeout_s=60,
                     what="the worker's watcher to judge peers")


async def subscribe_confirmed(redis, channel: str):
    """A subscription to ``channel``, returned once Redis confirmed it."""
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)
    async with asyncio.timeout(5):
        while (await pubsub.get_message(timeout=1.0) or {}).get("type") != "subscribe":
            pass
    return pubsub


async def seconds_until_taken(queue: JobStore, job_id: str, worker: Worker, since: float) -> float:
    async def taken() -> bool:
        return (await queue.get_job(MODEL, job_id)).worker == worker.worker_id
    await wait_for(taken, timeout=10, every=0.005)
    return time.monotonic() - since
