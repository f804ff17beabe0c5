"""Processes and small helpers the queue microbenchmarks (pickup, relay) share: a throwaway
redis-server, ``python -m tests.bench.<mode>`` subprocesses, percentiles, markdown tables, and
the held jobs of pickup's "10,000 held" model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgspec

from tests.conftest import REPO, free_port, start_redis

__all__ = ["REPO", "percentile", "stats_ms", "load_average", "free_port", "start_redis", "report_head",
           "measured_report", "markdown_table", "spawn", "stop", "fill_held", "renew_held", "save"]

HELD_MODEL_SLOTS = 64  # jobs per fake peer consumer in the held case (one worker's engine slots)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stats_ms(values: Sequence[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(percentile(values, 50), 4), "p90_ms": round(percentile(values, 90), 4),
            "p99_ms": round(percentile(values, 99), 4), "min_ms": round(min(values), 4) if values else float("nan"),
            "max_ms": round(max(values), 4) if values else float("nan")}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def report_head(benchmark: str, measured: str, loads: list[list[float]]) -> dict:
    """What every queue benchmark's JSON report starts with."""
    return {"benchmark": benchmark, "measured": measured, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {"cpus": os.cpu_count(), "loadavg_before_after": loads}}


def measured_report(benchmark: str, measured: str, measure: Coroutine[Any, Any, dict]) -> dict:
    """Run a benchmark's ``measure`` and return its report: the head, then what it measured. The
    load average is read before and after, so a reader can tell a busy box from a slow llmq."""
    loads = [load_average()]
    result = asyncio.run(measure)
    loads.append(load_average())
    return {**report_head(benchmark, measured, loads), **result}


def save(result: dict, out: str, table: str) -> None:
    """Write a benchmark's JSON report and print its table."""
    Path(out).write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    print(table)
    print(f"\nwritten: {out}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def spawn(args: Sequence[str]) -> subprocess.Popen:
    """``python -m tests.bench.<mode> ...`` from the repository root; its logs are discarded."""
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def fill_held(redis, keys, model: str, n: int) -> None:
    """``n`` jobs running on other workers: records, entries at level 0 (where default-priority
    work lives), delivered to fake peer consumers of ``HELD_MODEL_SLOTS`` jobs each."""
    from shared.codec import job_to_hash
    from shared.keys import GROUP
    from shared.queue import now_ms
    from shared.schemas import GenerationRequest, JobRecord

    req = GenerationRequest(model=model, prompt="held")
    queue = keys.queue(model, 0)
    for start in range(0, n, 1000):
        pipe = redis.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            job_id = f"held{i:06d}"
            peer = f"peer-{i // HELD_MODEL_SLOTS}"
            record = JobRecord(id=job_id, model=model, request=req, queued_at=now_ms(), status="running",
                               worker=peer, attempt=1, started_at=now_ms())
            pipe.hset(keys.job(model, job_id), mapping=job_to_hash(record))
            pipe.xadd(queue, {"job": job_id})
        await pipe.execute()
    for c in range((n + HELD_MODEL_SLOTS - 1) // HELD_MODEL_SLOTS):
        await redis.xreadgroup(GROUP, f"peer-{c}", {queue: ">"}, count=HELD_MODEL_SLOTS)


async def renew_held(redis, keys, model: str) -> None:
    """Reset the held entries' idle time, as each peer's heartbeat does (XCLAIM ... JUSTID)."""
    from shared.keys import GROUP

    queue = keys.queue(model, 0)
    pending = await redis.xpending_range(queue, GROUP, "-", "+", 100_000)
    by_peer: dict[bytes, list[bytes]] = {}
    for p in pending:
        by_peer.setdefault(p["consumer"], []).append(p["message_id"])
    pipe = redis.pipeline(transaction=False)
    for peer, ids in by_peer.items():
        pipe.xclaim(queue, GROUP, peer, 0, ids, idle=0, justid=True)
    await pipe.execute()
