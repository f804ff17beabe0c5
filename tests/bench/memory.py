"""Redis memory per finished job: what a job leaves behind for LLMQ_RESULT_TTL_S once it ended.

``python -m tests.bench.memory [--jobs 2000 --tokens 64 500]`` starts its own redis-server (as
llmq starts one: shared/redis.py's ``SERVER_OPTIONS``; ``--stock-redis`` leaves Redis's own
defaults), the real API on a local port with default settings, and, in this process, a real
:class:`workers.runner.Worker` with a zero-delay scripted engine (one token per engine step, as a
real engine streams). Jobs arrive as a user sends them: streamed ``/v1/completions`` requests of
about 24 words (tests/bench/workload.py's prompts), ``max_tokens`` N, ``ignore_eos``, 16 at a time,
each read to its ``[DONE]``. Two modes, on the same server one after the other:

- ``stream``: the worker compacts nothing (its compact log is switched off), so the per-token
  stream is kept, as before the compaction (shared/eventlog.py).
- ``compact``: as shipped: the script that ends a job replaces its stream with the compact log,
  a field of the job's record.

Per mode, after a warm-up request and again once every job ended and the worker settled:
``INFO memory`` used_memory (the delta per job is *the* figure), and ``MEMORY USAGE key SAMPLES 0``
summed per kind of key (job record, event log, idempotency, usage, tenant, queue streams, ...:
every key a SCAN finds). What used_memory holds beyond the keys' own sizes is the keyspace's
bookkeeping: one expires-dict entry per key with a TTL, and both dicts' bucket arrays
(``DEBUG HTSTATS``), reported too. Also: the job's result (what a client fetches) against the
target "result + 1 KB"; this process's CPU per token (the difference between the modes is the
compaction's cost in the worker); and a check that every job's log reads back as it was streamed.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
import uuid
from collections import Counter

import httpx
from redis.asyncio import Redis

from shared.codec import job_from_hash
from shared.config import load_settings
from shared.events import Done, Tokens
from shared.keys import LEVELS, SHARDS, Keys
from shared.logging import configure_logging
from shared.queue import Consumer, JobStore
from shared.redis import connect
from tests.bench.procs import free_port, load_average, markdown_table, report_head, save, start_redis, stop
from tests.bench.workload import prompts_for
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import serve_api
from workers.runner import Worker

__all__ = ["main", "measure", "TARGET_OVER_RESULT"]

MODEL = "mem"
MODES = ("stream", "compact")
CONCURRENCY = 16
TARGET_OVER_RESULT = 1024
"""A finished job may keep at most its result plus this many bytes (issue 28's target)."""


class _StreamingWorker(Worker):
    """The worker as before the compaction: every log stays a per-event stream."""

    @staticmethod
    def _attempt(d):
        attempt = Worker._attempt(d)
        attempt.whole_log = False  # its end never compacts the log
        return attempt


def key_kinds(keys: Keys, model: str) -> list[tuple[str, str]]:
    """(kind, key name prefix) for every key llmq makes, longest prefix first, from shared/keys.py."""
    kinds = [("job record", keys.job(model, "")),
             ("idempotency", keys.idempotency(model, "")), ("usage", keys.usage(model)),
             ("tenant", keys.tenant(model, "")), ("tokens window", keys.tokens(model)),
             ("tenants", keys.tenants(model)), ("fair share", keys.fair(model)), ("fair share", keys.fair_clock(model)),
             ("group", keys.group(model, "")), ("dead letters", keys.dead(model)), ("webhooks", keys.webhooks(model)),
             ("workers", keys.workers(model)), ("presence", keys.worker("")), ("presence", keys.models()),
             ("presence", keys.apis()), ("presence", keys.api_home("")), ("presence", keys.heartbeats()),
             ("recent jobs", keys.recent(model)), ("throughput", keys.finished(model)),
             ("throughput", keys.history(model))]
    for shard in range(SHARDS):  # a job's token keys, under its token shard's tag
        kinds += [("event log", keys.events_in(model, shard)), ("token fence", keys.fence(model, shard)),
                  ("ending", keys.ending_in(model, shard))]
    kinds += [("queue stream", keys.queue(model, level)) for level in range(LEVELS)]
    kinds += [("waiting stream", keys.waiting(model, level)) for level in range(LEVELS)]
    return sorted(kinds, key=lambda kind: -len(kind[1]))


def kind_of(kinds: list[tuple[str, str]], key: str) -> str:
    return next((kind for kind, start in kinds if key.startswith(start)), "other")


async def _census(redis: Redis, keys: Keys) -> tuple[int, Counter, Counter, dict]:
    """used_memory, then per kind of key the sum of MEMORY USAGE and the count, and the dicts' stats."""
    await redis.execute_command("MEMORY", "PURGE")
    used = int((await redis.info("memory"))["used_memory"])
    kinds = key_kinds(keys, MODEL)
    names = [k.decode() async for k in redis.scan_iter(match=f"{keys.prefix}:*", count=1000)]
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.memory_usage(name, samples=0)
    sizes, counts = Counter(), Counter()
    for name, size in zip(names, await pipe.execute(), strict=True):
        kind = kind_of(kinds, name)
        sizes[kind] += size or 0
        counts[kind] += 1
    return used, sizes, counts, await _dict_stats(redis)


async def _dict_stats(redis: Redis) -> dict:
    """The main and expires dicts' table sizes (buckets): 8 bytes each, counted in used_memory."""
    try:
        text = (await redis.execute_command("DEBUG", "HTSTATS", "0")).decode()
    except Exception:  # DEBUG refused (Redis 7+ by default): the bookkeeping is then estimated only
        return {}
    sizes = [int(n) for n in re.findall(r"table size: (\d+)", text)]
    main, expires = (text.split("[Expires HT]") + [""])[:2]
    pick = lambda part: sum(int(n) for n in re.findall(r"table size: (\d+)", part))  # noqa: E731
    return {"main_buckets": pick(main), "expires_buckets": pick(expires), "all": sum(sizes)}


async def _send(client: httpx.AsyncClient, prompts: list[str], tokens: int) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
        async with gate, client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, (await resp.aread())[:300]
            tail = b""
            async for chunk in resp.aiter_bytes():
                tail = (tail + chunk)[-32:]
            assert tail.rstrip().endswith(b"data: [DONE]"), tail

    await asyncio.gather(*(one(p) for p in prompts))


async def _run_mode(url: str, mode: str, jobs: int, tokens: int) -> dict:
    prefix = f"mem-{mode}-{tokens}-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    settings = load_settings({}, redis_url=url, prefix=prefix, served_model_name=MODEL, port=free_port(),
                             log_level="warning")
    redis = connect(url)
    queue = JobStore(redis, keys, result_ttl_s=settings.result_ttl_s, usage_days=settings.usage_days)
    worker_cls = _StreamingWorker if mode == "stream" else Worker
    consumer = Consumer(redis, keys, result_ttl_s=settings.result_ttl_s, usage_days=settings.usage_days)
    worker = worker_cls(settings, consumer, ScriptedEngine(delay_s=0.0), worker_id=f"bench-{prefix}")
    task = asyncio.create_task(worker.run())
    try:
        async with serve_api(settings) as base, httpx.AsyncClient(base_url=base, timeout=120) as client:
            while await redis.zscore(keys.workers(MODEL), worker.worker_id) is None:
                await asyncio.sleep(0.05)
            # One job first: what exists once per model or tenant (usage, tenant, streams) is then
            # there before the count starts, and what follows is the jobs' own memory.
            await _send(client, ["warm up"], 2)
            await asyncio.sleep(0.5)
            before, sizes0, counts0, dicts0 = await _census(redis, keys)
            cpu = time.process_time()
            prompts = prompts_for(jobs, f"{mode}{tokens}-")
            await _send(client, prompts, tokens)
            cpu = time.process_time() - cpu
            await asyncio.sleep(0.5)  # every job's end is written before its [DONE]; presence settles
            after, sizes1, counts1, dicts1 = await _census(redis, keys)
            job_keys = [k async for k in redis.scan_iter(match=keys.job(MODEL, "*"), count=1000)]
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    try:
        return await _report(redis, queue, keys, mode, jobs, tokens, job_keys, cpu, (before, sizes0, counts0, dicts0),
                             (after, sizes1, counts1, dicts1))
    finally:
        await redis.aclose()


async def _report(redis: Redis, queue: JobStore, keys: Keys, mode: str, jobs: int, tokens: int, job_keys: list,
                  cpu: float, first: tuple, last: tuple) -> dict:
    (before, sizes0, counts0, dicts0), (after, sizes1, counts1, dicts1) = first, last
    records = [job_from_hash(raw) for raw in await _pipelined(redis, "hgetall", job_keys)]
    mine = [r for r in records if r.request.prompt != "warm up"]
    assert len(mine) == jobs and all(r.status == "done" for r in mine), Counter(r.status for r in mine)
    results = [len(raw or b"") for raw in await _pipelined(redis, "hget", [keys.job(MODEL, r.id) for r in mine],
                                                           "result")]
    record_sizes = await _pipelined(redis, "memory_usage", [keys.job(MODEL, r.id) for r in mine], samples=0)
    # The log: a stream of its own, or (compacted) a field of the record.
    log_sizes = [n or 0 for n in await _pipelined(redis, "memory_usage", [keys.events(MODEL, r.id) for r in mine],
                                                  samples=0)]
    compacts = await _pipelined(redis, "hget", [keys.job(MODEL, r.id) for r in mine], "log")
    log_sizes = [n or len(c or b"") for n, c in zip(log_sizes, compacts, strict=True)]
    checked = 0
    # Every log reads back whole: the text streamed, every token once, seqs 1..n (an event holds
    # each step its job made while the worker's flusher was busy: one or several tokens).
    for record in mine[:: max(1, jobs // 50)]:
        events = await queue.read_events(MODEL, record.id)
        deltas = [d for e in events if isinstance(e, (Tokens, Done)) for d in e.deltas]
        assert "".join(d.text for d in deltas) == expected_text(record.request.prompt or "", tokens), record.id
        assert sum(len(d.token_ids) for d in deltas) == tokens, record.id
        assert [e.seq for e in events] == list(range(1, len(events) + 1)) and isinstance(events[-1], Done), record.id
        checked += 1
    per_job = (after - before) / jobs
    kinds = sorted(set(sizes0) | set(sizes1), key=lambda k: -(sizes1[k] - sizes0[k]))
    breakdown = {k: {"bytes_per_job": round((sizes1[k] - sizes0[k]) / jobs, 1), "keys": counts1[k] - counts0[k]}
                 for k in kinds}
    keys_total = sum(sizes1.values()) - sum(sizes0.values())
    new_keys = sum(counts1.values()) - sum(counts0.values())
    buckets = (dicts1.get("all", 0) - dicts0.get("all", 0)) * 8
    result = statistics.fmean(results)
    return {
        "mode": mode, "jobs": jobs, "tokens_per_job": tokens,
        "log_type": "stream" if await redis.exists(keys.events(MODEL, mine[0].id)) else "record field",
        "used_memory_delta_bytes_per_job": round(per_job),
        "used_memory_delta_bytes_per_token": round(per_job / tokens, 1),
        "result_bytes_per_job": round(result),
        "limit_bytes_per_job": round(result) + TARGET_OVER_RESULT,
        "within_limit": per_job <= result + TARGET_OVER_RESULT,
        "memory_usage_bytes_per_job": round(keys_total / jobs),
        "record_bytes_per_job": round(statistics.fmean(record_sizes)),  # with the compact log in it
        "log_bytes_per_job": round(statistics.fmean(log_sizes)),
        "log_bytes_max": max(log_sizes),
        "keys_per_job": round(new_keys / jobs, 2),
        "by_kind": breakdown,
        # used_memory beyond MEMORY USAGE: each key with a TTL has an entry in the expires dict
        # (a dictEntry, 24 bytes plus the allocator's header), and both dicts' bucket arrays grow
        # in powers of two (8 bytes a bucket); the rest is the allocator's rounding and what the
        # server holds for its clients at that moment.
        "keyspace_bytes_per_job": round((per_job * jobs - keys_total) / jobs, 1),
        "dict_buckets_bytes_per_job": round(buckets / jobs, 1) if dicts1 else None,
        "logs_read_back": checked,
        # This process's CPU (the worker, the scripted engine, the client; not the API's process
        # share: it runs here too) per token: the difference between the modes is the compaction.
        "process_cpu_us_per_token": round(cpu / (jobs * tokens) * 1e6, 2),
    }


async def _pipelined(redis: Redis, command: str, names: list, *args: object, **kwargs: object) -> list:
    out = []
    for start in range(0, len(names), 500):
        pipe = redis.pipeline(transaction=False)
        for name in names[start:start + 500]:
            getattr(pipe, command)(name, *args, **kwargs)
        out += await pipe.execute()
    return out


async def measure(url: str, jobs: int, token_counts: list[int], modes: list[str] | tuple[str, ...] = MODES
                  ) -> list[dict]:
    rows = []
    for tokens in token_counts:
        for mode in modes:
            rows.append(await _run_mode(url, mode, jobs, tokens))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per mode and size (default 2000)")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 500], help="tokens per job (default 64 500)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--stock-redis", action="store_true",
                   help="start redis-server with its own defaults, not llmq's SERVER_OPTIONS")
    p.add_argument("--redis-url", help="use this Redis instead of starting one (its other keys are left alone)")
    p.add_argument("--out", default="bench-memory.json")
    a = p.parse_args(argv)
    configure_logging("warning", True)  # the worker logs every job it ends at info
    loads = [load_average()]
    proc, url = (None, a.redis_url) if a.redis_url else start_redis()
    try:
        if a.stock_redis:
            asyncio.run(_stock(url))
        rows = asyncio.run(measure(url, a.jobs, a.tokens, a.modes))
    finally:
        if proc is not None:
            stop(proc)
    loads.append(load_average())
    result = {**report_head("memory", "Redis bytes per finished job through the API, per-token stream vs compact log",
                            loads), "stock_redis": a.stock_redis, "rows": rows}
    headers = ["tokens/job", "log kept as", "used_memory / job", "/ token", "result", "limit (result + 1 KB)",
               "MEMORY USAGE / job", "record", "log", "keyspace", "keys / job", "CPU µs/token"]
    table = markdown_table(headers, [
        [r["tokens_per_job"], r["log_type"], r["used_memory_delta_bytes_per_job"],
         r["used_memory_delta_bytes_per_token"], r["result_bytes_per_job"], r["limit_bytes_per_job"],
         r["memory_usage_bytes_per_job"], r["record_bytes_per_job"], r["log_bytes_per_job"],
         r["keyspace_bytes_per_job"], r["keys_per_job"], r["process_cpu_us_per_token"]] for r in rows])
    kinds = markdown_table(["tokens/job", "log kept as", "kind of key", "MEMORY USAGE / job", "keys added"], [
        [r["tokens_per_job"], r["log_type"], kind, v["bytes_per_job"], v["keys"]]
        for r in rows for kind, v in r["by_kind"].items() if v["bytes_per_job"] or v["keys"]])
    save(result, a.out, table + "\n\n" + kinds)


async def _stock(url: str) -> None:
    """Redis's own default for the largest value a hash keeps in its compact encoding."""
    redis = connect(url)
    try:
        await redis.config_set("hash-max-ziplist-value", 64)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    main()
