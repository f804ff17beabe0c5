"""A dead worker's jobs continue on a peer within a second, not a lease; a live one keeps its jobs.

Real Redis, scripted engines (``ContextEngine``: each token a function of the whole context, like
greedy decoding, so a continued job must equal an uninterrupted run). A worker's control
subscription is its sign of life (workers/presence.py): the killed worker here is a separate
process killed with SIGKILL, so its sockets close as a real crash closes them; the peer that takes
over runs in the test's process, with a lease far longer than the takeover, so only the watcher
can explain a continuation within a second. The other cases prove the watcher takes nothing from a
worker that is alive: stopped (SIGSTOP), with its connection dropped and re-made, during a Redis
restart, or starting up.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.config import load_settings
from shared.events import Event, TokenDelta, Tokens
from shared.keys import GROUP, Keys
from shared.queue import Consumer, JobStore, Outbound
from shared.redis import connect
from tests.conftest import REPO
from tests.support import inprocess_workers
from tests.support.aof_redis import AofRedis
from tests.support.faults import lost_and_duplicated
from tests.support.inprocess_workers import (
    MODEL,
    TAKEOVER_S,
    Client,
    assert_seamless,
    judging,
    seconds_until_taken,
    submit,
    subscribe_confirmed,
    wait_for,
)
from tests.support.processes import spawn_logged
from tests.support.scripted_engine import ContextEngine, ScriptedEngine, expected_ids
from workers.presence import RECONNECT_MAX_S
from workers.runner import Worker

make_worker = inprocess_workers.make_worker  # in-process workers with a ContextEngine, on real Redis

LEASE_S = 30.0  # far beyond every takeover here: a job that moves within seconds moved by the watcher


class Stamped(list):
    """A client's events with the time each arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, event: Event) -> None:
        super().append(event)
        self.times.append(time.monotonic())


def stamped_client(redis, queue: JobStore) -> Client:
    client = Client(redis, queue)
    client.events = Stamped()
    return client


# --- a worker in its own process ------------------------------------------------------------

async def _serve(redis_url: str, prefix: str, delay_s: float) -> None:
    settings = load_settings({}, redis_url=redis_url, prefix=prefix, served_model_name=MODEL, block_ms=100,
                             heartbeat_s=0.2, lease_s=LEASE_S)
    redis = connect(redis_url, block_ms=settings.block_ms)
    try:
        await Worker(settings, Consumer(redis, Keys(prefix)), ContextEngine(delay_s)).run()
    finally:
        await redis.aclose()


def spawn_worker(redis_url: str, prefix: str, log: Path, delay_s: float = 0.02) -> subprocess.Popen:
    return spawn_logged([sys.executable, "-m", "tests.integration.test_fast_takeover", redis_url, prefix,
                         str(delay_s)], log, cwd=REPO)


async def worker_of(redis, keys: Keys, proc: subprocess.Popen, log: Path) -> str:
    """The worker id of the process ``proc``, once it is ready."""
    async def ready() -> str | None:
        assert proc.poll() is None, log.read_text()
        for worker in await redis.zrange(keys.workers(MODEL), 0, -1):
            if await redis.hget(keys.worker(worker.decode()), "pid") == str(proc.pid).encode():
                return worker.decode()
        return None
    return await wait_for(ready, timeout=60, every=0.05)


async def logged_on(queue: JobStore, job_id: str, worker: str, events: int) -> None:
    async def check() -> bool:
        job = await queue.get_job(MODEL, job_id)
        return job is not None and job.worker == worker and len(await queue.read_events(MODEL, job_id)) >= events
    await wait_for(check)


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


async def consumers(redis, keys: Keys) -> set[str]:
    return {c["name"].decode() for q in keys.queues(MODEL) for c in await redis.xinfo_consumers(q, GROUP)}


@dataclass
class Pair:
    """A job streaming on worker A, a separate process; worker B in this process, judging peers."""

    proc: subprocess.Popen
    a: str  # A's worker id
    b: Worker
    queue: JobStore
    client: Client  # with stamped events
    job_id: str


@pytest.fixture
async def streaming_on_a_process(make_worker, redis, redis_url, keys, prefix, tmp_path):
    procs: list[subprocess.Popen] = []

    async def start(prompt: str, max_tokens: int) -> Pair:
        log = tmp_path / "worker-a.log"
        procs.append(proc := spawn_worker(redis_url, prefix, log))
        a = await worker_of(redis, keys, proc, log)
        queue = JobStore(redis, keys)
        client = stamped_client(redis, queue)
        job_id = await client.start(prompt, max_tokens)
        await logged_on(queue, job_id, a, 10)
        b = await make_worker(delay_s=0.005, lease_s=LEASE_S)
        await judging(b.worker)
        return Pair(proc, a, b.worker, queue, client, job_id)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)


# --- a dead worker --------------------------------------------------------------------------

@pytest.mark.faults
async def test_a_sigkilled_workers_job_continues_on_a_peer_within_a_second(streaming_on_a_process, redis, keys,
                                                                          figures):
    pair = await streaming_on_a_process("kill me", 150)
    pair.proc.kill()
    killed_at = time.monotonic()
    pair.proc.wait(10)
    published = len(await pair.queue.read_events(MODEL, pair.job_id))  # A's last write is in the log now
    events = await pair.client.finish()
    next_event_s = pair.client.events.times[published] - killed_at  # seq published + 1: the peer's first
    stall = longest_gap(pair.client.events.times)
    ids = [t for e in events if hasattr(e, "deltas") for d in e.deltas for t in d.token_ids]
    figures.requests_sent, figures.completed = 1, int(ids == expected_ids("kill me", 150))
    figures.tokens_lost, figures.tokens_duplicated = lost_and_duplicated(expected_ids("kill me", 150), ids)
    figures.seconds.update(next_event_after_kill_s=next_event_s, longest_stall_s=stall)
    print(f"killed after {published} events; the peer's first event {next_event_s:.3f} s after the kill "
          f"(LLMQ_TAKEOVER_S {TAKEOVER_S}, lease {LEASE_S} s); longest gap {stall:.3f} s")

    assert_seamless(events, "kill me", 150)
    assert 10 <= published < 150, "the kill landed mid-stream"
    job = await pair.queue.get_job(MODEL, pair.job_id)
    assert job.status == "done" and job.worker == pair.b.worker_id and job.attempt == 2
    assert next_event_s < 1.0, "the peer continued the job within a second of the kill"
    reclaimed = sum(s.value for s in pair.b.metrics.samples() if s.name == "llmq_worker_jobs_reclaimed_total")
    assert reclaimed == 1, "a takeover counts as a reclaim"
    assert pair.a not in await consumers(redis, keys), "the dead consumer left the group once it held nothing"
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0


# --- live workers keep their jobs -----------------------------------------------------------

@pytest.mark.faults
async def test_a_sigstopped_worker_keeps_its_job(streaming_on_a_process, figures):
    """A stall shorter than the lease (SIGSTOP for 2 s, four takeover windows): the stopped
    process keeps its sockets, so its subscription stays and no peer takes its job."""
    pair = await streaming_on_a_process("stop me", 150)
    pair.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2.0)
        assert (await pair.queue.get_job(MODEL, pair.job_id)).worker == pair.a
    finally:
        pair.proc.send_signal(signal.SIGCONT)
    events = await pair.client.finish()
    stall = longest_gap(pair.client.events.times)
    figures.requests_sent, figures.completed = 1, 1
    figures.seconds["longest_stall_s"] = stall

    assert_seamless(events, "stop me", 150)
    job = await pair.queue.get_job(MODEL, pair.job_id)
    assert job.status == "done" and job.worker == pair.a and job.attempt == 1, "no takeover: one attempt, on A"
    assert len(pair.b.engine.requests) == 1, "the peer ran its warm-up only"
    assert stall >= 1.9, "the stop did stall the stream (else this proved nothing)"


async def _pubsub_ids(redis) -> set[int]:
    return {c["id"] for c in await redis.client_list(_type="pubsub")}


async def test_a_dropped_control_connection_reconnects_and_keeps_its_jobs(make_worker, redis, keys):
    """Redis (or a proxy) drops the worker's control connection, three times: redis-py reconnects
    and re-subscribes at once, well inside the takeover window, so the job stays where it is."""
    before = await _pubsub_ids(redis)
    a = await make_worker(delay_s=0.02, lease_s=LEASE_S)
    [a_conn] = await _pubsub_ids(redis) - before
    client = Client(redis, a.queue)
    job_id = await client.start("blip", 200)
    await logged_on(a.queue, job_id, a.worker.worker_id, 10)
    b = await make_worker(delay_s=0.005, lease_s=LEASE_S)
    await judging(b.worker)
    others = await _pubsub_ids(redis) - {a_conn}
    for _ in range(3):
        [a_conn] = await _pubsub_ids(redis) - others  # A's current connection
        assert await redis.client_kill_filter(_id=a_conn) == 1
        await asyncio.sleep(TAKEOVER_S * 1.5)
        subscribed = await a.worker.presence.registry.subscribed(MODEL, [a.worker.worker_id])
        assert subscribed == [1], "A re-subscribed"
    events = await client.finish()

    assert_seamless(events, "blip", 200)
    job = await a.queue.get_job(MODEL, job_id)
    assert job.worker == a.worker.worker_id and job.attempt == 1
    assert not b.worker.engine.requests[1:] and not a.worker.engine.aborted


async def held_by_ghost(redis, keys: Keys, prompt: str, max_tokens: int):
    """A job delivered to consumer "ghost", whose control channel has a subscriber as a live
    worker's has: (job store, consumer, job id, the delivery, the subscription)."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    job_id = await submit(store, prompt, max_tokens)
    pubsub = await subscribe_confirmed(redis, keys.worker_control("ghost"))
    [held] = (await consumer.pick(MODEL, "ghost", 1)).deliveries
    return store, consumer, job_id, held, pubsub


async def test_a_subscription_gone_for_less_than_the_window_keeps_the_job_and_gone_longer_loses_it(
        make_worker, redis, keys):
    """A consumer that holds a job is judged by its control channel alone: gone for 0.2 s (less
    than LLMQ_TAKEOVER_S) five times, it keeps the job; gone for good, a peer takes the job after
    the window, not before, and the old consumer's late writes are refused (the fence)."""
    store, consumer, job_id, held, pubsub = await held_by_ghost(redis, keys, "ghost", 20)
    b = await make_worker(delay_s=0.005, lease_s=LEASE_S)
    await judging(b.worker)
    try:
        for _ in range(5):
            await pubsub.aclose()
            await asyncio.sleep(0.2)
            pubsub = await subscribe_confirmed(redis, keys.worker_control("ghost"))
            await asyncio.sleep(0.3)
        pending = await redis.xpending_range(keys.queue(MODEL), GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"ghost"], "the job stayed with its consumer"
        assert (await store.get_job(MODEL, job_id)).attempt == 1
    finally:
        await pubsub.aclose()
    taken_s = await seconds_until_taken(store, job_id, b.worker, since=time.monotonic())
    print(f"taken over {taken_s:.3f} s after its consumer's subscription went (LLMQ_TAKEOVER_S {TAKEOVER_S})")
    assert TAKEOVER_S <= taken_s < 1.0

    async def done() -> bool:
        return (await store.get_job(MODEL, job_id)).status == "done"
    await wait_for(done)
    job = await store.get_job(MODEL, job_id)
    assert job.attempt == 2 and job.result.choices[0].token_ids == expected_ids("ghost", 20)
    assert "ghost" not in await consumers(redis, keys)
    # The fence: a write with the old owner's (worker, attempt) is refused and reaches nothing.
    logged = await store.read_events(MODEL, job_id)
    late = Outbound.of(job_id, Tokens(seq=len(logged) + 1, deltas=[TokenDelta(token_ids=[1], text="x")]),
                       attempt=held.attempt)
    assert (await consumer.flush(MODEL, [late], "ghost")).lost == [job_id]
    assert await store.read_events(MODEL, job_id) == logged


async def test_a_takeover_never_puts_more_jobs_into_the_engine_than_its_slots(redis, keys, monkeypatch):
    """The watcher fills both free slots of B with a dead consumer's jobs while B's reader blocks
    waiting for work (for 60 s: still blocked whatever the machine's pace), holding no slot; new
    jobs then arrive and wake that read while both taken-over jobs still run (3 s each). They are
    left waiting (picked once a slot frees), not started beside the taken-over ones."""
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    ghost_jobs = [await submit(store, f"ghost{i}", 150) for i in range(2)]
    pubsub = await subscribe_confirmed(redis, keys.worker_control("ghost"))
    assert len((await consumer.pick(MODEL, "ghost", 2)).deliveries) == 2
    # Every blocking read B's reader makes, from its first: whether new entries woke it, and how
    # many slots it had for them then (its pick follows at once, reserving what is available).
    admitted: list[tuple[bool, int]] = []
    wait_for_work = Consumer.wait_for_work

    async def recording(self, *args, **kwargs):
        arrived = await wait_for_work(self, *args, **kwargs)
        [worker] = [o.worker for o in own if o.queue is self]
        admitted.append((arrived, worker.slots.available))
        return arrived

    monkeypatch.setattr(Consumer, "wait_for_work", recording)
    engine = ScriptedEngine(delay_s=0.02)  # 150 tokens: three seconds a job
    own: list[_Own] = []
    try:
        b = await _own_worker(redis, keys, own, engine, prefix=keys.prefix, lease_s=LEASE_S, max_num_seqs=2,
                              block_ms=60_000)
        await judging(b.worker)  # meanwhile B's reader blocks, holding none of its 2 slots
        await pubsub.aclose()

        async def both_taken() -> bool:
            return engine.active == 2
        await wait_for(both_taken, timeout=5, every=0.005)
        new_jobs = [await submit(store, f"new{i}", 5) for i in range(2)]

        async def all_done() -> bool:
            return all(job.status == "done" for job in await store.get_jobs(MODEL, [*ghost_jobs, *new_jobs]))
        await wait_for(all_done, timeout=40, every=0.02)
    finally:
        await stop_own(own)
    assert engine.peak_active == 2, "never more jobs in the engine than its slots"
    assert any(arrived and not kept for arrived, kept in admitted), \
        f"the blocked read woke with new entries and had no room for them: {admitted}"


async def test_a_watcher_judges_nobody_until_its_own_subscription_has_been_back_a_while(make_worker, redis, keys):
    """When every subscription drops at once (Redis restarted), peers re-subscribe one after
    another: a watcher whose own connection just came back must not take the others' absence
    for death. Here B's control connection is dropped at the moment a consumer's subscription
    goes for good: B takes the job only once its own has been back for 2 x RECONNECT_MAX_S."""
    store, _, job_id, _, pubsub = await held_by_ghost(redis, keys, "ghost", 5)
    before = await _pubsub_ids(redis)
    b = await make_worker(delay_s=0.005, lease_s=LEASE_S)
    [b_conn] = await _pubsub_ids(redis) - before
    await judging(b.worker)
    await redis.client_kill_filter(_id=b_conn)
    await pubsub.aclose()
    taken_s = await seconds_until_taken(store, job_id, b.worker, since=time.monotonic())
    print(f"taken over {taken_s:.3f} s after the drop (grace {2 * RECONNECT_MAX_S} s + window {TAKEOVER_S} s)")
    assert taken_s >= 2 * RECONNECT_MAX_S + TAKEOVER_S - 0.05  # B's re-subscription came back a little later
    assert taken_s < 2 * RECONNECT_MAX_S + TAKEOVER_S + 1.0


@pytest.mark.faults
async def test_a_redis_restart_takes_no_job_from_a_live_worker(tmp_path, figures):
    """Every subscription drops together when Redis restarts (AOF on, so the pending entries
    survive); each worker re-subscribes when it is back. The job stays on its worker."""
    server = AofRedis(tmp_path)
    server.start()
    redis = connect(server.url)
    own: list[_Own] = []
    try:
        prefix = f"restart-{uuid.uuid4().hex[:6]}"
        keys = Keys(prefix)
        settings = dict(redis_url=server.url, prefix=prefix, lease_s=LEASE_S)
        a, store = await _own_worker(redis, keys, own, ContextEngine(0.02), **settings), JobStore(redis, keys)
        job_id = await submit(store, "restart", 200)
        await logged_on(store, job_id, a.worker.worker_id, 10)
        b = await _own_worker(redis, keys, own, ContextEngine(0.005), **settings)
        await judging(b.worker)
        server.stop()
        await asyncio.sleep(1.5)
        server.start()
        restarted = time.monotonic()

        async def done() -> bool:
            job = await store.get_job(MODEL, job_id)
            return job is not None and job.status == "done"
        await wait_for(done, timeout=60, every=0.05)
        job = await store.get_job(MODEL, job_id)
        figures.requests_sent, figures.completed = 1, int(job.result.choices[0].token_ids == expected_ids("restart",
                                                                                                         200))
        figures.seconds["finished_after_restart_s"] = time.monotonic() - restarted
        assert job.worker == a.worker.worker_id and job.attempt == 1, "no takeover, no lease lost"
        assert job.result.choices[0].token_ids == expected_ids("restart", 200)
        assert len(b.worker.engine.requests) == 1, "the peer ran its warm-up only"
    finally:
        await stop_own(own)
        await redis.aclose()
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


class _Own:
    def __init__(self, worker: Worker, queue: Consumer, task: asyncio.Task) -> None:
        self.worker, self.queue, self.task = worker, queue, task


async def _own_worker(redis, keys: Keys, own: list[_Own], engine, **settings) -> _Own:
    """A worker with settings make_worker's workers cannot have (another Redis, a longer read);
    the caller stops what ``own`` lists."""
    full = load_settings({}, **{"served_model_name": MODEL, "block_ms": 100, "heartbeat_s": 0.2, **settings})
    queue = Consumer(redis, keys)
    worker = Worker(full, queue, engine)
    own.append(_Own(worker, queue, asyncio.create_task(worker.run())))
    while not worker.ready or not worker.presence.control_up.is_set():
        await asyncio.sleep(0.01)
    return own[-1]


async def stop_own(own: list[_Own]) -> None:
    for w in own:
        w.worker.stop()
    if own:
        await asyncio.wait([w.task for w in own], timeout=20)


async def test_a_worker_reads_no_job_before_its_control_subscription_is_confirmed(make_worker, redis, keys,
                                                                                 monkeypatch):
    """Peers would take a consumer holding jobs without a subscription for a dead worker's, so a
    worker starting up reads nothing until Redis confirmed its subscription (here delayed 1 s)."""
    from shared import registry as registry_module

    real = registry_module.node_client

    async def slow(*args, **kwargs):
        await asyncio.sleep(1.0)
        return await real(*args, **kwargs)

    monkeypatch.setattr(registry_module, "node_client", slow)  # what Registry.control_subscription connects with
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    job_id = await submit(store, "early", 5)
    started = time.monotonic()
    a = await make_worker(delay_s=0.005, lease_s=LEASE_S)  # ready (warmed up) before it subscribed
    assert not a.worker.presence.control_up.is_set() and time.monotonic() - started < 0.9
    assert (await store.get_job(MODEL, job_id)).status == "queued"
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0, "nothing read yet"

    async def done() -> bool:
        return (await store.get_job(MODEL, job_id)).status == "done"
    await wait_for(done)
    assert (await store.get_job(MODEL, job_id)).worker == a.worker.worker_id


if __name__ == "__main__":  # the worker process of the tests above
    parser = argparse.ArgumentParser()
    parser.add_argument("redis_url")
    parser.add_argument("prefix")
    parser.add_argument("delay_s", type=float)
    args = parser.parse_args()
    asyncio.run(_serve(args.redis_url, args.prefix, args.delay_s))
