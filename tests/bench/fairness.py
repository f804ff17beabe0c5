"""The fair-share pick's cost with many tenants waiting: one pick at 1, 100 and 10,000 tenants.

``python -m tests.bench.fairness [--tenants 1 100 10000 --picks 2000 --rounds 5 ...]`` starts its
own redis-server (as llmq does) and, per tenants count N, a model whose level-0 backlog holds
jobs of N tenants (t0..tN-1, ``--jobs-per-tenant`` each, equal weights and equal jobs), queued
through ``JobStore.enqueue`` as the API queues them. Then it picks as a worker does:
``Consumer.pick(model, consumer, count)`` with ``count`` = 1 and 8 (a worker asks for its free
slots), which runs read.lua (the pick: the lowest virtual token counter in the level's fair set;
and the claim, claim.lua). After each call, every job picked is replaced by a
new one of the same tenant (``JobStore.enqueue``, timed too), so the backlog stays at N tenants and
its size through the run: what is measured is a pick among N waiting tenants, not a draining
queue. Picked jobs stay claimed (running, never run): the same for every N.

Every (N, count) runs ``--picks`` jobs per round, the rounds interleaved (the order rotated each
round). Per call: wall time at the client; redis-server CPU, from its main thread's run time
(``/proc/<pid>/schedstat``, exact to the ns and read without a round trip, so the server is
local); and the scripts' own time, from ``INFO commandstats`` (EVALSHA usec; read between calls,
outside both windows). The report gives each figure as the median across rounds of the round's
figure, and the ratio of the medians at the largest N to the smallest: O(1) or O(log N) per pick
keeps it near 1 (issue 17).

It also checks the fair share itself: with equal weights and equal jobs every tenant's turn
comes once per N picks (each aligned window of N picks names every tenant once), and every
picked job is one of the N tenants' (its record's tenant is the tenant that queued it).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import uvloop
from redis.asyncio import Redis

from shared.admission import new_job
from shared.keys import Keys
from shared.queue import Consumer, JobStore
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.bench.procs import REPO, load_average, markdown_table, percentile, report_head, save, start_redis, stop
from tests.bench.report import machine, versions

__all__ = ["main", "run"]

T = TypeVar("T")

CONSUMER = "bench-fairness"
FILL_CONCURRENCY = 200  # enqueues in flight while the backlog is filled (not timed per job)
REQUEST = dict(prompt="x", sampling=SamplingParams(max_tokens=16))  # every job the same: equal VTC charges


class Server:
    """What one operation cost the redis-server: its main thread's CPU (the thread that runs
    every command; None when the server is not a local process) and the scripts' usec as
    ``INFO commandstats`` counts them (EVALSHA: the whole script, the commands it calls included)."""

    def __init__(self, redis: Redis, pid: int | None) -> None:
        self.redis = redis
        self.schedstat = Path(f"/proc/{pid}/schedstat") if pid else None
        self._script_usec = 0

    def cpu_ns(self) -> int:
        return int(self.schedstat.read_text().split()[0]) if self.schedstat else 0

    async def script_usec(self) -> int:
        """EVALSHA usec since the last call (INFO is the one round trip here, made between
        measured calls so that it is in neither window)."""
        stats = await self.redis.info("commandstats")
        usec = sum(int(stats.get(name, {}).get("usec", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))
        delta, self._script_usec = usec - self._script_usec, usec
        return delta

    async def measure(self, op: Callable[[], Awaitable[T]]) -> tuple[T, float, float, float]:
        """``op()``'s result, wall µs, server CPU µs and script µs."""
        await self.script_usec()
        cpu = self.cpu_ns()
        started = time.perf_counter()
        result = await op()
        wall = (time.perf_counter() - started) * 1e6
        cpu = (self.cpu_ns() - cpu) / 1000
        return result, wall, cpu, float(await self.script_usec())


async def local_pid(redis: Redis, url: str) -> int | None:
    """The pid of a redis-server given by URL, when it runs on this host (its CPU is then read
    from /proc); None otherwise."""
    if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    pid = int((await redis.info("server"))["process_id"])
    try:
        return pid if Path(f"/proc/{pid}/comm").read_text().startswith("redis") else None
    except OSError:
        return None


@dataclass
class Tenants:
    """One tenants count: its model, its backlog, every job it queued and every pick it made."""

    n: int
    model: str
    per_tenant: int
    owner: dict[str, str] = field(default_factory=dict)  # job id -> the tenant that queued it
    picked: list[str] = field(default_factory=list)  # tenants in pick order, warm-up calls included
    foreign: int = 0  # picks of a job whose record's tenant is not the one that queued it
    not_run: int = 0  # picks whose claim did not say "run"
    short: int = 0  # calls that got fewer jobs than asked (the backlog ran dry: must stay 0)
    fill: dict = field(default_factory=dict)
    enqueue_us: list[float] = field(default_factory=list)
    enqueue_cpu_us: list[float] = field(default_factory=list)
    enqueue_script_us: list[float] = field(default_factory=list)
    enqueue_rounds: list[dict] = field(default_factory=list)

    def job(self, tenant: str) -> JobRecord:
        record = new_job(GenerationRequest(model=self.model, **REQUEST), owner="", default_timeout_s=None,
                         tenant=tenant)
        self.owner[record.id] = tenant
        return record


@dataclass
class Target:
    """One (tenants count, count per call): its samples per call, and each round's figures."""

    tenants: Tenants
    count: int
    wall_us: list[float] = field(default_factory=list)
    cpu_us_per_pick: list[float] = field(default_factory=list)
    script_us_per_pick: list[float] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.tenants.n} tenants, count {self.count}"


async def fill(queue: JobStore, server: Server, tenants: Tenants) -> None:
    """Queue ``per_tenant`` jobs for each tenant, tenant after tenant: all of t0's, then t1's, so
    a queue that picked in arrival order would give one tenant several turns in a row, which the
    rotation check would catch; the fair share gives each its turn regardless."""
    records = [tenants.job(f"t{i}") for i in range(tenants.n) for _ in range(tenants.per_tenant)]
    await server.script_usec()
    cpu = server.cpu_ns()
    started = time.perf_counter()
    for i in range(0, len(records), FILL_CONCURRENCY):
        await asyncio.gather(*(queue.enqueue(r) for r in records[i:i + FILL_CONCURRENCY]))
    wall = time.perf_counter() - started
    cpu_us = (server.cpu_ns() - cpu) / 1000
    script_us = await server.script_usec()
    tenants.fill = {"jobs": len(records), "wall_s": round(wall, 3),
                    "server_cpu_us_per_job": round(cpu_us / len(records), 2) if server.schedstat else None,
                    "script_us_per_job": round(script_us / len(records), 2)}


async def call(store: JobStore, consumer: Consumer, server: Server, target: Target, *, timed: bool) -> None:
    """One worker read: pick ``count`` jobs; then replace each by a new job of its tenant."""
    tenants, count = target.tenants, target.count
    picked, wall, cpu, script = await server.measure(lambda: consumer.pick(tenants.model, CONSUMER, count))
    deliveries = picked.deliveries
    if timed:
        target.wall_us.append(wall)
        target.cpu_us_per_pick.append(cpu / count)
        target.script_us_per_pick.append(script / count)
    tenants.short += len(deliveries) < count
    recorded = await asyncio.gather(*(consumer.redis.hget(consumer.keys.job(tenants.model, d.job_id), "tenant")
                                      for d in deliveries))
    for delivery, tenant in zip(deliveries, recorded, strict=True):
        queued_by = tenants.owner.get(delivery.job_id, "?")
        tenants.picked.append(queued_by)
        tenants.foreign += tenant is None or tenant.decode() != queued_by
        tenants.not_run += delivery.state != "run"
    for delivery in deliveries:
        record = tenants.job(tenants.owner.get(delivery.job_id, "?"))
        _, wall, cpu, script = await server.measure(lambda r=record: store.enqueue(r))
        if timed:
            tenants.enqueue_us.append(wall)
            tenants.enqueue_cpu_us.append(cpu)
            tenants.enqueue_script_us.append(script)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run_round(store: JobStore, consumer: Consumer, server: Server, target: Target, picks: int, warm: int) -> None:
    for _ in range(warm):
        await call(store, consumer, server, target, timed=False)
    first = len(target.wall_us)
    for _ in range(math.ceil(picks / target.count)):
        await call(store, consumer, server, target, timed=True)
    wall = target.wall_us[first:]
    target.rounds.append({
        "calls": len(wall), "p50_us": round(percentile(wall, 50), 1), "p99_us": round(percentile(wall, 99), 1),
        "cpu_us_per_pick": round(_median(target.cpu_us_per_pick[first:]), 2),
        "cpu_us_per_pick_mean": round(statistics.fmean(target.cpu_us_per_pick[first:]), 2),
        "script_us_per_pick": round(_median(target.script_us_per_pick[first:]), 2),
    })


def rotation(tenants: Tenants) -> dict:
    """Whether every aligned window of N picks named each tenant once (and the last, partial
    one none twice), and how many picks each tenant got."""
    n, picked = tenants.n, tenants.picked
    expected = {f"t{i}" for i in range(n)}
    broken_at = None
    for start in range(0, len(picked), n):
        window = picked[start:start + n]
        if len(set(window)) != len(window) or not set(window) <= expected:
            broken_at = start
            break
    counts = Counter(picked)
    return {"picks": len(picked), "full_windows": len(picked) // n, "broken_at": broken_at,
            "held": broken_at is None, "unknown_tenants": sorted(set(counts) - expected)[:10],
            "picks_per_tenant_min": min((counts[t] for t in expected), default=0),
            "picks_per_tenant_max": max(counts.values(), default=0)}


async def run(args: argparse.Namespace) -> dict:
    redis_proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    redis = connect(url)
    prefix = f"bench-fair-{uuid.uuid4().hex[:6]}"
    store, consumer = JobStore(redis, Keys(prefix)), Consumer(redis, Keys(prefix))
    try:
        server = Server(redis, redis_proc.pid if redis_proc is not None else await local_pid(redis, url))
        configs = []
        for n in args.tenants:
            # At least one more job waiting than a call picks, however few the tenants.
            per_tenant = max(args.jobs_per_tenant, math.ceil((max(args.counts) + 1) / n))
            configs.append(Tenants(n=n, model=f"fair-{n}", per_tenant=per_tenant))
        loads = [load_average()]
        for tenants in configs:
            await consumer.ensure_group(tenants.model)
            await fill(store, server, tenants)
        targets = [Target(tenants, count) for tenants in configs for count in args.counts]
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            marks = {id(t): len(t.enqueue_us) for t in configs}
            for target in order:
                await run_round(store, consumer, server, target, args.picks, args.warm)
            for tenants in configs:
                done = tenants.enqueue_us[marks[id(tenants)]:]
                tenants.enqueue_rounds.append({
                    "jobs": len(done), "p50_us": round(percentile(done, 50), 1),
                    "cpu_us": round(_median(tenants.enqueue_cpu_us[marks[id(tenants)]:]), 2),
                    "script_us": round(_median(tenants.enqueue_script_us[marks[id(tenants)]:]), 2)})
        loads.append(load_average())
        # The backlog at the end: every tenant still waiting (in the fair set), as many jobs as at the start.
        depths = {t.n: {"tenants_in_fair_set": await redis.zcard(store.keys.fair(t.model)),
                        "jobs_waiting": await redis.xlen(store.keys.waiting(t.model))} for t in configs}
    finally:
        await redis.aclose()
        if redis_proc is not None:
            stop(redis_proc)
    return report(args, configs, targets, loads, depths, server.schedstat is not None)


def report(args, configs: list[Tenants], targets: list[Target], loads: list[list[float]], depths: dict[int, dict],
           local: bool) -> dict:
    def med(rounds: list[dict], key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] == r[key]]
        return round(statistics.median(values), 2) if values else None

    rows = []
    for t in targets:
        rows.append({
            "tenants": t.tenants.n, "count": t.count, "calls": len(t.wall_us), "picks": len(t.wall_us) * t.count,
            "p50_us": med(t.rounds, "p50_us"), "p99_us": med(t.rounds, "p99_us"),
            "cpu_us_per_pick": med(t.rounds, "cpu_us_per_pick") if local else None,
            "cpu_us_per_pick_mean": med(t.rounds, "cpu_us_per_pick_mean") if local else None,
            "script_us_per_pick": med(t.rounds, "script_us_per_pick"),
            "enqueue_us_per_job": med(t.tenants.enqueue_rounds, "p50_us"),
            "enqueue_cpu_us_per_job": med(t.tenants.enqueue_rounds, "cpu_us") if local else None,
            "rounds": t.rounds,
        })
    low, high = min(args.tenants), max(args.tenants)
    ratios: dict[str, float | None] = {}
    for count in args.counts:
        a = next(r for r in rows if r["tenants"] == low and r["count"] == count)
        b = next(r for r in rows if r["tenants"] == high and r["count"] == count)
        # The enqueue figures are the tenants count's (every count's re-enqueues): said once.
        keys = ("p50_us", "p99_us", "cpu_us_per_pick", "script_us_per_pick")
        if count == args.counts[0]:
            keys += ("enqueue_us_per_job", "enqueue_cpu_us_per_job")
        for key in keys:
            if a[key] and b[key] is not None:
                ratios[f"{key} {high}/{low} tenants" + ("" if key.startswith("enqueue") else f", count {count}")] = \
                    round(b[key] / a[key], 3)
    fairness = {str(c.n): {**rotation(c), "short_calls": c.short, "foreign_picks": c.foreign, "not_run": c.not_run,
                           "jobs_waiting_at_start": c.n * c.per_tenant, **depths[c.n]} for c in configs}
    return {
        **report_head("fairness", "Consumer.pick (read.lua's fair-share pick + claim.lua's claim) per call with N "
                                  "tenants waiting at level 0: client wall µs, redis-server main-thread CPU µs per "
                                  "job picked (/proc schedstat), EVALSHA usec per job picked (INFO commandstats); "
                                  "JobStore.enqueue per job; each the median across rounds of the round's figure",
                                  loads),
        "machine_details": machine(),
        "llmq_commit": versions()["llmq_commit"],
        "settings": {"tenants": args.tenants, "counts": args.counts, "picks": args.picks, "rounds": args.rounds,
                     "warm_calls": args.warm, "jobs_per_tenant": {str(c.n): c.per_tenant for c in configs},
                     "server_cpu": "schedstat" if local else None},
        "fill": {str(c.n): c.fill for c in configs},
        "rows": rows,
        "ratios": ratios,
        "fairness": fairness,
        "fair": all(f["held"] and not f["short_calls"] and not f["foreign_picks"] and not f["not_run"]
                    for f in fairness.values()),
    }


def table(result: dict) -> str:
    headers = ["tenants", "count", "picks", "p50 µs", "p99 µs", "redis CPU µs/pick", "script µs/pick",
               "enqueue µs/job", "enqueue redis CPU µs"]
    out = markdown_table(headers, [[r["tenants"], r["count"], r["picks"], r["p50_us"], r["p99_us"],
                                    r["cpu_us_per_pick"], r["script_us_per_pick"], r["enqueue_us_per_job"],
                                    r["enqueue_cpu_us_per_job"]] for r in result["rows"]])
    out += "\n\n" + markdown_table(["ratio of medians", "value"], [[k, v] for k, v in result["ratios"].items()])
    out += "\n\n" + markdown_table(
        ["tenants", "picks checked", "full windows", "rotation held", "picks/tenant min-max", "short calls"],
        [[n, f["picks"], f["full_windows"], f["held"], f"{f['picks_per_tenant_min']}-{f['picks_per_tenant_max']}",
          f["short_calls"]] for n, f in result["fairness"].items()])
    m = result["machine_details"]
    out += (f"\n\n{result['date']}, {m['cores']} cores {m['cpu']}, llmq {result['llmq_commit']}, "
            f"load average before/after: {result['machine']['loadavg_before_after']}")
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tests.bench.fairness", description=__doc__.split("\n")[0])
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 100, 10_000],
                   help="tenants waiting (default 1 100 10000)")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8], help="jobs asked per read (default 1 8)")
    p.add_argument("--picks", type=int, default=2000, help="jobs picked per (tenants, count) per round (default 2000)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--warm", type=int, default=5, help="untimed calls per (tenants, count) per round (default 5)")
    p.add_argument("--jobs-per-tenant", type=int, default=3,
                   help="jobs each tenant keeps waiting (default 3; more when the tenants are fewer than a read asks)")
    p.add_argument("--redis-url", default="",
                   help="use this Redis instead of starting one (its other keys are left alone)")
    p.add_argument("--out", default=str(REPO / "bench-fairness.json"))
    args = p.parse_args(argv)
    result = uvloop.run(run(args))  # the loop a deployed worker runs
    save(result, args.out, table(result))
    return result


if __name__ == "__main__":
    main()
