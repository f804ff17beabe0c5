"""Queue pickup latency: enqueue -> the worker starts the job, llmq against arq.

``python -m tests.bench.pickup [--rounds 5 --jobs 500 ...]`` starts its own redis-server and, as
separate processes (never sharing the enqueuer's event loop), one llmq worker per llmq target
(``workers.runner.Worker`` with a zero-delay one-token scripted engine) and one arq worker per arq
target. Jobs are enqueued one at a time, in interleaved rounds (every target once per round, the
order rotated), each after a random gap so a polling queue is sampled at a random phase:

- ``llmq``: ``JobStore.enqueue`` (the API's call). Pickup = the record's ``started_at - queued_at``:
  ``queued_at`` is taken right before the enqueue script, ``started_at`` by the worker's claim
  (the pick's, read.lua); both are ``now_ms()`` (``time.time()``) on the same host, so one clock.
- ``llmq, 10k held``: the same on a model that already holds 10,000 unfinished jobs, delivered to
  other consumers of the group with live leases (its PEL holds 10,000 entries, its depth is
  10,000). A backlog *ahead* of the job would measure the service time of the backlog, not the
  queue; these are the jobs a busy deployment holds while a new one arrives. Those consumers
  look alive as     live workers do: their control channels have a subscriber (else the worker's
  watcher would take their jobs over as a dead worker's; workers/runner.py).
- ``arq``: ``ArqRedis.enqueue_job`` of a function that records ``time.time()`` when it starts;
  pickup = that - the time taken right before the enqueue. At arq's default ``poll_delay`` (0.5 s)
  and at 0.01 s. An arq worker is paused (SIGSTOP) outside its own rounds, so its polling never
  loads the box while another target is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import subprocess
import time
import uuid
from collections.abc import Sequence

import uvloop

from shared.redis import connect
from tests.bench.procs import (
    REPO,
    fill_held,
    load_average,
    markdown_table,
    renew_held,
    report_head,
    save,
    spawn,
    start_redis,
    stats_ms,
    stop,
)

__all__ = ["main"]

# How often the held jobs' fake peers renew their leases during a round: well inside the worker's
# LLMQ_LEASE_S (10 s), as a real worker's heartbeat is (three renewals per lease).
HELD_RENEW_S = 2.5



# --- the processes under test ---------------------------------------------------------------

async def serve_llmq_worker(redis_url: str, prefix: str, model: str) -> None:
    """One llmq worker with a zero-delay scripted engine (one token per job): only the queue's
    own path is measured. SIGTERM drains and exits."""
    from shared.config import load_settings
    from shared.keys import Keys
    from shared.logging import configure_logging
    from shared.queue import Consumer
    from tests.support.scripted_engine import ScriptedEngine
    from workers.runner import Worker

    settings = load_settings({}, redis_url=redis_url, prefix=prefix, served_model_name=model)
    configure_logging(settings.log_level, True)
    redis = connect(redis_url, block_ms=settings.block_ms)
    worker = Worker(settings, Consumer(redis, Keys(prefix)), ScriptedEngine(delay_s=0.0), worker_id=f"bench-{model}")
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    try:
        await worker.run()
    finally:
        await redis.aclose()


async def serve_floor(redis_url: str, stream: str) -> None:
    """No llmq code: one consumer blocked in XREADGROUP notes when each entry arrives. The floor
    every Redis Streams queue pays on this machine at this moment."""
    redis = connect(redis_url)
    await redis.xgroup_create(stream, "floor", id="0", mkstream=True)
    while True:
        reply = await redis.xreadgroup("floor", "c", {stream: ">"}, count=1, block=2000)
        now = time.time()
        for _, items in reply or []:
            for _, fields in items:
                await redis.rpush(fields[b"reply"], repr(now))


async def arq_pickup(ctx: dict, key: str) -> None:
    """The arq job: note when it started (the first thing it does), for the enqueuer to read."""
    started = time.time()
    await ctx["redis"].rpush(key, repr(started))


def serve_arq_worker(redis_url: str, queue_name: str, poll_delay: float | None) -> None:
    from arq.connections import RedisSettings
    from arq.worker import Worker as ArqWorker

    extra = {} if poll_delay is None else {"poll_delay": poll_delay}  # None: arq's default
    ArqWorker(functions=[arq_pickup], redis_settings=RedisSettings.from_dsn(redis_url), queue_name=queue_name,
              **extra).run()


# --- the enqueuer side ----------------------------------------------------------------------

async def subscribe_holders(redis, queue, model: str):
    """Subscribe the control channel of every consumer that holds entries of ``model``, as each
    live worker does its own, and return the subscription once Redis confirmed every channel."""
    from shared.registry import Registry

    names = await Registry(redis, queue.keys).holders(model, "")
    pubsub = redis.pubsub()
    await pubsub.subscribe(*(queue.keys.worker_control(name) for name in names))
    confirmed = 0
    async with asyncio.timeout(10):
        while confirmed < len(names):
            message = await pubsub.get_message(timeout=1.0)
            confirmed += message is not None and message["type"] == "subscribe"
    return pubsub


class Target:
    """One measured configuration: how to run one pickup, and its samples (ms)."""

    def __init__(self, name: str, gap_s: float) -> None:
        self.name = name
        self.gap_s = gap_s  # the random gap before each job is uniform in [0, gap_s]
        self.samples: list[float] = []
        self.rounds: list[float] = []  # each round's median
        self.lost = 0

    async def before_round(self) -> None: ...

    async def after_round(self) -> None: ...

    async def once(self) -> float:
        raise NotImplementedError

    async def run_round(self, jobs: int, warm: int = 2) -> None:
        await self.before_round()
        try:
            for _ in range(warm):
                await self.once()
            got = []
            for _ in range(jobs):
                await asyncio.sleep(random.uniform(0, self.gap_s))
                got.append(await self.once())
            self.samples += got
            self.rounds.append(statistics.median(got) if got else float("nan"))
        finally:
            await self.after_round()


class LlmqTarget(Target):
    def __init__(self, name: str, redis, url: str, prefix: str, model: str, *, gap_s: float, held: int = 0) -> None:
        from shared.keys import Keys
        from shared.queue import Consumer, JobStore

        super().__init__(name, gap_s)
        self.redis, self.url, self.model, self.held = redis, url, model, held
        self.keys = Keys(prefix)
        self.store, self.consumer = JobStore(redis, self.keys), Consumer(redis, self.keys)
        self.prefix = prefix
        self.proc: subprocess.Popen | None = None
        self.attempts: list[int] = []
        self.peers = None  # the held jobs' consumers' control subscriptions
        self.heartbeat: asyncio.Task[None] | None = None  # the held jobs' peers renewing their leases

    async def start(self) -> None:
        """Fill the held jobs first (else our worker would take them), make their consumers look
        alive, then start the worker."""
        await self.consumer.ensure_group(self.model)
        if self.held:
            await fill_held(self.redis, self.keys, self.model, self.held)
            self.peers = await subscribe_holders(self.redis, self.store, self.model)
        self.proc = spawn(["-m", "tests.bench.pickup", "--serve-llmq", self.prefix, self.model,
                           "--redis-url", self.url])
        deadline = time.monotonic() + 60
        while await self.redis.zscore(self.keys.workers(self.model), f"bench-{self.model}") is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the llmq worker for {self.model} did not start")
            await asyncio.sleep(0.05)

    async def before_round(self) -> None:
        if self.held:  # what the peers' heartbeats do: keep their leases live (idle time ~0)
            await renew_held(self.redis, self.keys, self.model)
            if self.heartbeat is None:  # and through the round too: one may outlast a lease
                self.heartbeat = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HELD_RENEW_S)
            await renew_held(self.redis, self.keys, self.model)

    async def once(self) -> float:
        from shared.queue import now_ms
        from shared.schemas import GenerationRequest, JobRecord, SamplingParams

        job_id = uuid.uuid4().hex
        req = GenerationRequest(model=self.model, prompt="x", sampling=SamplingParams(max_tokens=1))
        # The job's one event (its Done) is published on its live channel (no API relays it): wait
        # for it there, subscribed (and confirmed) first. Not in its event log: the end compacts
        # that into a string in the same script (shared/eventlog.py), which XREAD cannot wait on.
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.live(self.model, job_id))
            await pubsub.get_message(timeout=10)  # the confirmation
            await self.store.enqueue(JobRecord(id=job_id, model=self.model, request=req, queued_at=now_ms()),
                                     max_queued=2**62)
            reply = await pubsub.get_message(timeout=10)
        finally:
            await pubsub.aclose()
        if not reply:
            self.lost += 1
            return float("nan")
        # Read as the API reads a job: its end is logged (and published) a moment before its
        # record says so, and a read in between takes the logged end's status (JobStore.get_jobs).
        record = await self.store.get_job(self.model, job_id)
        if record is None or record.status != "done" or record.started_at is None:
            self.lost += 1
            return float("nan")
        self.attempts.append(record.attempt)
        return record.started_at - record.queued_at

    async def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            await asyncio.gather(self.heartbeat, return_exceptions=True)
        if self.peers is not None:
            await self.peers.aclose()

    async def held_kept(self) -> int:
        """How many held jobs are still pending on the consumers they were delivered to."""
        from shared.keys import GROUP

        summary = await self.redis.xpending(self.keys.queue(self.model), GROUP)
        return sum(int(c["pending"]) for c in summary["consumers"] if c["name"] != f"bench-{self.model}".encode())

    async def reclaim_cost(self, calls: int = 20) -> float:
        """ms per ``Consumer.reclaim`` call, as a worker with 64 free slots runs it (at most once a
        second): with every lease live it takes nothing, so this is its pure scanning cost."""
        if self.held:
            await renew_held(self.redis, self.keys, self.model)
        started = time.perf_counter()
        for _ in range(calls):
            taken = await self.consumer.reclaim(self.model, "bench-probe", 64, 10_000)
            assert not taken, "a live lease was reclaimed"
        return round((time.perf_counter() - started) * 1000 / calls, 3)


class FloorTarget(Target):
    """Bare XADD -> a blocked XREADGROUP in another process: the Redis round trip floor."""

    def __init__(self, redis, url: str, prefix: str, gap_s: float) -> None:
        super().__init__("floor: bare XADD -> XREADGROUP", gap_s)
        self.redis, self.url = redis, url
        self.stream, self.replies = f"{prefix}:floor", f"{prefix}:floor:started"  # bench-only keys
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        self.proc = spawn(["-m", "tests.bench.pickup", "--serve-floor", self.stream, "--redis-url", self.url])
        await self.once()

    async def once(self) -> float:
        sent = time.time()
        await self.redis.xadd(self.stream, {"reply": self.replies})
        reply = await self.redis.blpop([self.replies], timeout=60)
        if reply is None:
            self.lost += 1
            return float("nan")
        return (float(reply[1]) - sent) * 1000


class ArqTarget(Target):
    def __init__(self, name: str, redis, redis_url: str, prefix: str, poll_delay: float | None) -> None:
        super().__init__(name, poll_delay if poll_delay is not None else 0.5)
        self.redis, self.url, self.poll_delay = redis, redis_url, poll_delay
        self.queue_name = f"{prefix}:arq:{name}"  # bench-only keys, under the bench's own prefix
        self.results = f"{self.queue_name}:started"
        self.proc: subprocess.Popen | None = None
        self.pool = None

    async def start(self) -> None:
        from arq import create_pool
        from arq.connections import RedisSettings

        self.pool = await create_pool(RedisSettings.from_dsn(self.url), default_queue_name=self.queue_name)
        args = ["-m", "tests.bench.pickup", "--serve-arq", self.queue_name, "--redis-url", self.url]
        if self.poll_delay is not None:
            args += ["--poll-delay", str(self.poll_delay)]
        self.proc = spawn(args)
        await self.once()  # the worker is up once it runs a job
        self.proc.send_signal(signal.SIGSTOP)

    async def before_round(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    async def after_round(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    async def once(self) -> float:
        assert self.pool is not None
        sent = time.time()
        await self.pool.enqueue_job("arq_pickup", self.results, _queue_name=self.queue_name)
        reply = await self.redis.blpop([self.results], timeout=60)
        if reply is None:
            self.lost += 1
            return float("nan")
        return (float(reply[1]) - sent) * 1000

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()


async def run(args: argparse.Namespace) -> dict:
    redis_proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    redis = connect(url)
    llmq = LlmqTarget("llmq", redis, url, prefix, "pickup", gap_s=args.llmq_gap)
    held = LlmqTarget(f"llmq, {args.held} held", redis, url, prefix, "pickup-held", gap_s=args.llmq_gap,
                      held=args.held)
    arq_default = ArqTarget("arq default (poll_delay=0.5)", redis, url, prefix, None)
    planned: list[tuple[Target, int]] = [
        (FloorTarget(redis, url, prefix, args.llmq_gap), args.jobs), (llmq, args.jobs),
        (held, args.jobs if args.held else 0), (ArqTarget("arq poll_delay=0.01", redis, url, prefix, 0.01),
                                                args.arq_jobs), (arq_default, args.arq_default_jobs)]
    targets = [(t, n) for t, n in planned if n > 0]
    reclaim_ms: dict[str, float] = {}
    try:
        for target, _ in targets:
            await target.start()  # type: ignore[attr-defined]
        loads = [load_average()]
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            for target, total in order:
                per_round = total // args.rounds + (1 if r < total % args.rounds else 0)
                await target.run_round(per_round)
        loads.append(load_average())
        if args.held:
            # Their consumers look alive (subscribed): the worker's watcher must have left them alone.
            assert await held.held_kept() == args.held, "a held job was taken from its live consumer"
        for target in (llmq, held) if args.held else (llmq,):
            reclaim_ms[target.name] = await target.reclaim_cost()
    finally:
        for target, _ in targets:
            proc = getattr(target, "proc", None)
            if proc is not None:
                stop(proc)
            if isinstance(target, (ArqTarget, LlmqTarget)):
                await target.close()
        await redis.aclose()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    result = report(args, [t for t, _ in targets], llmq, held if args.held else None, arq_default, loads)
    result["reclaim_call_ms"] = reclaim_ms
    return result


def report(args, targets: list[Target], llmq: LlmqTarget, held: LlmqTarget | None, arq_default: ArqTarget,
           loads: list[list[float]]) -> dict:
    rows = {t.name: {**stats_ms([s for s in t.samples if s == s]), "lost": t.lost,
                     "round_p50s_ms": [round(x, 4) for x in t.rounds]} for t in targets}
    llmq_p50 = rows[llmq.name]["p50_ms"]
    ratios: dict[str, float] = {}
    met: dict[str, bool] = {"llmq_p50_le_1ms": llmq_p50 <= 1.0}
    if arq_default.name in rows:
        ratios["llmq_over_arq_default_p50"] = round(llmq_p50 / rows[arq_default.name]["p50_ms"], 5)
        ratios["arq_default_over_llmq_p50"] = round(rows[arq_default.name]["p50_ms"] / llmq_p50, 1)
        met["llmq_100x_faster_than_arq_default"] = ratios["arq_default_over_llmq_p50"] >= 100
    if held is not None:
        ratios["held_over_empty_p50"] = round(rows[held.name]["p50_ms"] / llmq_p50, 3)
        paired = [h / e for h, e in zip(held.rounds, llmq.rounds, strict=False) if e]
        ratios["held_over_empty_p50_median_of_rounds"] = round(statistics.median(paired), 3) if paired else 0.0
        met["held_changes_p50_lt_10pct"] = abs(ratios["held_over_empty_p50"] - 1) < 0.10
    return {
        **report_head("pickup", "enqueue -> the worker starts the job (llmq: record started_at - queued_at; "
                                "arq: function start time - time before enqueue_job), ms", loads),
        "settings": {"rounds": args.rounds, "jobs": args.jobs, "arq_jobs": args.arq_jobs,
                     "arq_default_jobs": args.arq_default_jobs, "held": args.held, "llmq_gap_s": args.llmq_gap},
        "targets": rows,
        "ratios": ratios,
        "every_job_started_once": all(a == 1 for a in llmq.attempts + (held.attempts if held else [])),
        "targets_met": met,
    }


def table(result: dict) -> str:
    rows = [[name, r["n"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["lost"]] for name, r in result["targets"].items()]
    out = markdown_table(["target", "jobs", "p50 ms", "p90 ms", "p99 ms", "lost"], rows)
    ratios = result["ratios"]
    out += "\n\n" + markdown_table(["ratio (p50)", "value"], [[k, v] for k, v in ratios.items()])
    out += "\n\n" + markdown_table(["Consumer.reclaim call (a worker runs it <= once a second)", "ms"],
                                     [[k, v] for k, v in result["reclaim_call_ms"].items()])
    out += f"\n\nload average before/after: {result['machine']['loadavg_before_after']}"
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.pickup", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=500, help="llmq jobs per llmq target (over all rounds)")
    parser.add_argument("--arq-jobs", type=int, default=200, help="jobs for arq at poll_delay=0.01")
    parser.add_argument("--arq-default-jobs", type=int, default=30, help="jobs for arq at its default poll_delay")
    parser.add_argument("--held", type=int, default=10_000, help="unfinished jobs the 'held' model holds (0: skip)")
    parser.add_argument("--llmq-gap", type=float, default=0.01, help="llmq: max random gap between jobs (s)")
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    parser.add_argument("--out", default=str(REPO / "bench-pickup.json"))
    parser.add_argument("--serve-llmq", nargs=2, metavar=("PREFIX", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-arq", metavar="QUEUE", help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", metavar="STREAM", help=argparse.SUPPRESS)
    parser.add_argument("--poll-delay", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_llmq:
        uvloop.run(serve_llmq_worker(args.redis_url, *args.serve_llmq))  # the loop a deployed worker runs
        return
    if args.serve_floor:
        uvloop.run(serve_floor(args.redis_url, args.serve_floor))  # the same loop as llmq's worker
        return
    if args.serve_arq:
        serve_arq_worker(args.redis_url, args.serve_arq, args.poll_delay)
        return
    result = asyncio.run(run(args))
    save(result, args.out, table(result))


if __name__ == "__main__":
    main()
