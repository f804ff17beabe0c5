"""Redis work per generated token and per request: ``INFO commandstats`` over a worker's run.

``python -m tests.bench.commandstats [--jobs 256 --tokens 64 --delay-ms 0 1]`` starts its own
redis-server and, in this process, a real :class:`workers.runner.Worker` with a scripted engine
(one token per engine step, ``--delay-ms`` between steps: 0 is an engine faster than the flusher,
so a flush holds several steps of a job). Jobs are queued as the API queues them
(``JobStore.enqueue``, each followed by one relay channel, as an API process follows the jobs it
queued) and run to their end. The stats are reset once the worker is ready, so the figures are the
jobs' whole work (their enqueues included) plus the worker's heartbeats meanwhile; the
benchmark's own polling for their end (``HGETALL``) is left out.

Per command: calls and Redis-side µs (``usec``), per job and per generated token; ``evalsha`` is
the scripts, whose inner ``redis.call``\\ s are counted under their own commands too (Redis counts
both). Counts are what this measures: the µs move with the box's load, the calls do not.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from redis.asyncio import Redis

from shared.cluster import is_cluster
from shared.config import load_settings
from shared.keys import Keys
from shared.logging import configure_logging
from shared.queue import Consumer, JobStore, now_ms
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.bench.procs import load_average, markdown_table, report_head, save, start_redis, stop
from tests.support.scripted_engine import ScriptedEngine
from workers.runner import Worker

__all__ = ["main", "measure"]

MODEL = "stats"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun"


async def _start_worker(redis: Redis, url: str, prefix: str, model: str,
                        engine: ScriptedEngine) -> tuple[Worker, asyncio.Task[None], JobStore]:
    """A real worker in this process on ``redis``, ready, with its group and presence written (what
    follows is the jobs' own work): the worker, its task and its queue."""
    settings = load_settings({}, redis_url=url, prefix=prefix, served_model_name=model, block_ms=100,
                             max_num_seqs=64, log_level="warning")
    queue = JobStore(redis, Keys(prefix))
    worker = Worker(settings, Consumer(redis, Keys(prefix)), engine, worker_id=f"bench-{prefix}")
    task = asyncio.create_task(worker.run())
    while not worker.ready:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    return worker, task, queue


async def run_jobs(queue: JobStore, model: str, jobs: int, tokens: int, relay: str | None = None,
                   poll_s: float = 0.2) -> list[str]:
    """Queue ``jobs`` jobs of ``tokens`` tokens as the API does (followed by API process ``relay``
    on the relay channel of each job's token shard), and wait (polling every ``poll_s``) for every
    one to end; their ids. tests.bench.workercpu runs its jobs the same way."""
    ids = []
    for _ in range(jobs):
        rec = JobRecord(id=uuid.uuid4().hex, model=model, queued_at=now_ms(), request=GenerationRequest(
            prompt=PROMPT, sampling=SamplingParams(max_tokens=tokens, temperature=0.0)))
        channel = queue.keys.relay(model, relay, rec.id, sharded=is_cluster(queue.redis)) if relay else None
        ids.append(await queue.enqueue(rec, relay=channel))
    pending = set(ids)
    while pending:
        await asyncio.sleep(poll_s)
        records = await queue.get_jobs(model, sorted(pending))
        pending -= {r.id for r in records if r is not None and r.status not in ("queued", "running")}
    return ids


async def _commandstats(redis: Redis) -> dict[str, dict[str, float]]:
    info = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): {"calls": v["calls"], "usec": v["usec"]} for name, v in info.items()}


async def _run(redis: Redis, url: str, jobs: int, tokens: int, delay_ms: float) -> dict:
    prefix = f"stats-{uuid.uuid4().hex[:6]}"
    worker, task, queue = await _start_worker(redis, url, prefix, MODEL, ScriptedEngine(delay_s=delay_ms / 1000))
    await redis.config_resetstat()
    await run_jobs(queue, MODEL, jobs, tokens, relay="bench-api")
    after = await _commandstats(redis)
    worker.stop()
    before = {"hgetall": after.get("hgetall", {})}  # the polling above is this benchmark's own
    await asyncio.wait_for(task, 30)
    generated = jobs * tokens
    rows = []
    for name in sorted(after, key=lambda n: -after[n]["usec"]):
        calls = after[name]["calls"] - before.get(name, {}).get("calls", 0)
        usec = after[name]["usec"] - before.get(name, {}).get("usec", 0)
        if calls <= 0 or name in ("info", "config|resetstat", "config"):
            continue
        rows.append({"command": name, "calls": calls, "usec": usec,
                     "calls_per_token": round(calls / generated, 3), "usec_per_token": round(usec / generated, 3),
                     "calls_per_job": round(calls / jobs, 2), "usec_per_job": round(usec / jobs, 1)})
    total_usec = sum(r["usec"] for r in rows if r["command"] == "evalsha" or not _inside_scripts(r["command"]))
    return {"jobs": jobs, "tokens_per_job": tokens, "delay_ms": delay_ms, "rows": rows,
            "evalsha_calls_per_job": next((r["calls_per_job"] for r in rows if r["command"] == "evalsha"), 0),
            "usec_per_token_outside_inner": round(total_usec / generated, 3)}


def _inside_scripts(command: str) -> bool:
    """Commands this workload issues only from inside scripts (counted inside ``evalsha`` too)."""
    return command in ("hmget", "xadd", "xlen", "publish", "hset", "hdel", "expire", "xack", "xdel", "hincrby",
                       "srem", "del", "set", "hexists", "xrevrange", "zrange", "lpop", "llen", "zrem", "zadd",
                       "sadd", "scard", "xreadgroup", "xclaim", "hget", "exists", "rpush", "sismember")


async def measure(url: str, jobs: int, tokens: int, delays: list[float]) -> list[dict]:
    redis = connect(url)
    try:
        return [await _run(redis, url, jobs, tokens, delay) for delay in delays]
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.commandstats", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 1.0],
                   help="the scripted engine's time per step (default 0 1)")
    p.add_argument("--redis-url", help="use this Redis instead of starting one (its stats are reset)")
    p.add_argument("--out", default="bench-commandstats.json")
    a = p.parse_args(argv)
    configure_logging("warning", True)
    loads = [load_average()]
    proc, url = (None, a.redis_url) if a.redis_url else start_redis()
    try:
        runs = asyncio.run(measure(url, a.jobs, a.tokens, a.delay_ms))
    finally:
        if proc is not None:
            stop(proc)
    loads.append(load_average())
    result = {**report_head("commandstats", "Redis commands and µs per generated token and per job", loads),
              "runs": runs}
    tables = []
    for run in runs:
        tables.append(f"engine step {run['delay_ms']} ms, {run['jobs']} jobs x {run['tokens_per_job']} tokens:\n"
                      + markdown_table(["command", "calls", "usec", "calls/token", "µs/token", "calls/job", "µs/job"],
                                       [[r["command"], r["calls"], r["usec"], r["calls_per_token"],
                                         r["usec_per_token"], r["calls_per_job"], r["usec_per_job"]]
                                        for r in run["rows"]]))
    save(result, a.out, "\n\n".join(tables))


if __name__ == "__main__":
    main()
