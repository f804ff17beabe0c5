"""Redis memory per finished job: what a job leaves behind for LLMQ_RESULT_TTL_S once it ended.

``python -m tests.bench.memory [--jobs 2000 --tokens 64 500]`` starts its own redis-server and,
in this process, a real :class:`workers.runner.Worker` with a zero-delay scripted engine (one
token per engine step, as a real engine streams). Jobs are queued as the API queues them
(``Queue.enqueue``) and run to their end; then the model's keys are counted. Two modes, on the
same server one after the other:

- ``stream``: the worker compacts nothing (its compact log is switched off), so the per-token
  stream is kept, as before the compaction (shared/eventlog.py).
- ``compact``: as shipped: the script that ends a job replaces its stream with the compact log.

Per mode: ``INFO memory`` used_memory before and after (the delta per job), and the exact sum of
``MEMORY USAGE key SAMPLES 0`` over the job records and the logs, per job and per generated
token; and this process's CPU per token (the difference between the modes is the compaction's
cost in the worker). The report also checks that every job's log reads back as it was streamed (the events of
the ``stream`` mode's jobs and the ``compact`` mode's, token for token, are the same script).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from redis.asyncio import Redis

from shared.config import load_settings
from shared.events import Done, Tokens
from shared.keys import Keys
from shared.logging import configure_logging
from shared.queue import Queue, now_ms
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.bench.procs import load_average, markdown_table, report_head, save, start_redis, stop
from tests.support.scripted_engine import ScriptedEngine, expected_text
from workers.runner import Worker

__all__ = ["main", "measure", "start_worker", "run_jobs", "PROMPT"]

MODEL = "mem"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun"
MODES = ("stream", "compact")


class _StreamingWorker(Worker):
    """The worker as before the compaction: every log stays a per-event stream."""

    @staticmethod
    def _attempt(d):
        attempt = Worker._attempt(d)
        attempt.whole_log = False  # its end never compacts the log
        return attempt


async def _used_memory(redis: Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def start_worker(redis: Redis, url: str, prefix: str, model: str, engine: ScriptedEngine,
                       worker_cls: type[Worker] = Worker) -> tuple[Worker, asyncio.Task[None], Queue]:
    """A real worker in this process on ``redis``, ready, with its group and presence written (what
    follows is the jobs' own work): the worker, its task and its queue."""
    settings = load_settings({}, redis_url=url, prefix=prefix, served_model_name=model, block_ms=100,
                             max_num_seqs=64, log_level="warning")
    queue = Queue(redis, Keys(prefix))
    worker = worker_cls(settings, queue, engine, worker_id=f"bench-{prefix}")
    task = asyncio.create_task(worker.run())
    while not worker.ready:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    return worker, task, queue


async def run_jobs(queue: Queue, model: str, jobs: int, tokens: int, relay: str | None = None) -> list[str]:
    """Queue ``jobs`` jobs of ``tokens`` tokens as the API does (followed on ``relay``), and wait
    for every one to end; their ids."""
    ids = []
    for _ in range(jobs):
        rec = JobRecord(id=uuid.uuid4().hex, model=model, queued_at=now_ms(), request=GenerationRequest(
            prompt=PROMPT, sampling=SamplingParams(max_tokens=tokens, temperature=0.0)))
        ids.append(await queue.enqueue(rec, relay=relay))
    pending = set(ids)
    while pending:
        await asyncio.sleep(0.2)
        records = await queue.get_jobs(model, sorted(pending))
        pending -= {r.id for r in records if r is not None and r.status not in ("queued", "running")}
    return ids


async def _run_mode(redis: Redis, url: str, mode: str, jobs: int, tokens: int) -> dict:
    prefix = f"mem-{mode}-{tokens}-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    worker_cls = _StreamingWorker if mode == "stream" else Worker
    worker, task, queue = await start_worker(redis, url, prefix, MODEL, ScriptedEngine(delay_s=0.0), worker_cls)
    await redis.execute_command("MEMORY", "PURGE")
    before = await _used_memory(redis)
    cpu = time.process_time()
    ids = await run_jobs(queue, MODEL, jobs, tokens)
    cpu = time.process_time() - cpu
    worker.stop()
    await asyncio.wait_for(task, 30)
    await redis.execute_command("MEMORY", "PURGE")
    after = await _used_memory(redis)

    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.memory_usage(keys.job(MODEL, job_id), samples=0)
        pipe.memory_usage(keys.events(MODEL, job_id), samples=0)
    sizes = await pipe.execute()
    records, logs = sizes[0::2], sizes[1::2]
    results = [len(r or b"") for r in await asyncio.gather(*(redis.hget(keys.job(MODEL, j), "result") for j in ids))]
    # Every log reads back whole: the same text as the job's result, every token once, seqs 1..n
    # (an event carries every step its job made while the worker's flusher was busy).
    want = expected_text(PROMPT, tokens)
    checked = 0
    for job_id in ids[:: max(1, jobs // 50)]:
        events = await queue.read_events(MODEL, job_id)
        text = "".join(d.text for e in events if isinstance(e, (Tokens, Done)) for d in e.deltas)
        token_ids = [t for e in events if isinstance(e, (Tokens, Done)) for d in e.deltas for t in d.token_ids]
        assert text == want and len(token_ids) == tokens, job_id
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), job_id
        assert isinstance(events[-1], Done)
        checked += 1
    log_type = (await redis.type(keys.events(MODEL, ids[0]))).decode()
    per_job = (after - before) / jobs
    return {
        "mode": mode, "jobs": jobs, "tokens_per_job": tokens, "log_type": log_type,
        "used_memory_delta_bytes_per_job": round(per_job),
        "used_memory_delta_bytes_per_token": round(per_job / tokens, 1),
        "memory_usage_bytes_per_job": round((sum(records) + sum(logs)) / jobs),
        "memory_usage_bytes_per_token": round((sum(records) + sum(logs)) / jobs / tokens, 1),
        "record_bytes_per_job": round(statistics.fmean(records)),
        "log_bytes_per_job": round(statistics.fmean(logs)),
        "log_bytes_max": max(logs),
        "result_bytes_per_job": round(statistics.fmean(results)),
        "logs_read_back": checked,
        # This process's CPU (enqueuing, the worker, the scripted engine) per token: the same work
        # in both modes but the compaction, so the difference is what compacting costs the worker.
        "process_cpu_us_per_token": round(cpu / (jobs * tokens) * 1e6, 2),
    }


async def measure(url: str, jobs: int, token_counts: list[int]) -> list[dict]:
    redis = connect(url)
    try:
        rows = []
        for tokens in token_counts:
            for mode in MODES:
                rows.append(await _run_mode(redis, url, mode, jobs, tokens))
        return rows
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per mode and size (default 2000)")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 500], help="tokens per job (default 64 500)")
    p.add_argument("--redis-url", help="use this Redis instead of starting one (its other keys are left alone)")
    p.add_argument("--out", default="bench-memory.json")
    a = p.parse_args(argv)
    configure_logging("warning", True)  # the worker logs every job it ends at info
    loads = [load_average()]
    proc, url = (None, a.redis_url) if a.redis_url else start_redis()
    try:
        rows = asyncio.run(measure(url, a.jobs, a.tokens))
    finally:
        if proc is not None:
            stop(proc)
    loads.append(load_average())
    result = {**report_head("memory", "Redis bytes per finished job, per-token stream vs compact log", loads),
              "rows": rows}
    headers = ["tokens/job", "log kept as", "used_memory / job", "/ token", "MEMORY USAGE / job", "/ token",
               "record", "log", "result", "CPU µs/token"]
    table = markdown_table(headers, [
        [r["tokens_per_job"], r["log_type"], r["used_memory_delta_bytes_per_job"],
         r["used_memory_delta_bytes_per_token"], r["memory_usage_bytes_per_job"], r["memory_usage_bytes_per_token"],
         r["record_bytes_per_job"], r["log_bytes_per_job"], r["result_bytes_per_job"],
         r["process_cpu_us_per_token"]] for r in rows])
    save(result, a.out, table)


if __name__ == "__main__":
    main()
