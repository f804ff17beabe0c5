"""Preemption, measured: a light tenant's time to first token under another tenant's flood of long
jobs, and what the flood pays for it, with preemption on and off (issue 30's benchmark;
docs/tenants.md#preemption).

``python -m tests.bench.preemption [--rounds 2]`` starts two deployments of llmq on the fast set's
engine (64 slots), each with its own Redis, one web process and one worker: ``preemption on`` (the
defaults) and ``preemption off`` (LLMQ_PREEMPT=false). In each round, the deployments in turn
(order rotated):

- **alone:** the light tenant's TTFT with nothing else running (5 requests, one at a time);
- **flood:** the heavy tenant queues 128 jobs of 1,536 tokens at once (fire-and-poll: two batches of
  the engine's 64 slots), and while they run the light tenant sends one streamed request of 8
  tokens a second, each on time whether the last has its first token or not.

Each reports the light tenant's TTFT alone (p50) and under the flood (p50, p99, max; streamed,
the client's clock), how long one flood job holds its slot (median, start to end), the flood's
throughput (its tokens over the time from its first job queued to its last ended), and the
flood's preemptions (its usage, counted as its jobs end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from shared.config import DEFAULT_MODEL, load_settings
from tests.bench.affinity import _stream
from tests.bench.procs import markdown_table, measured_report, percentile, save
from tests.bench.serving import TARGET_SETS, Deployment, start_deployment

__all__ = ["main"]

DEPLOYMENTS = {"preemption on": "true", "preemption off": "false"}
HEADER = "x-tenant"
FLOOD, FLOOD_TOKENS = 128, 1536


async def _light(client: httpx.AsyncClient, d: Deployment) -> float:
    ttft, *_ = await _stream(client, f"{d.url}/v1/completions", {
        "model": d.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    return ttft * 1000


async def run(d: Deployment) -> dict:
    async with httpx.AsyncClient(timeout=600, headers={HEADER: "light"}) as light:
        alone = [await _light(light, d) for _ in range(5)]
        before = int(await d.redis.hget(d.keys.usage(d.model), "heavy:preemptions") or 0)
        body = {"model": d.model, "prompt": ["Tell me a long story"] * FLOOD, "max_tokens": FLOOD_TOKENS,
                "temperature": 0, "ignore_eos": True}
        resp = await light.post(f"{d.url}/v1/completions", json=body,
                                headers={HEADER: "heavy", "Prefer": "respond-async"})
        assert resp.status_code == 202, resp.text
        group = resp.json()["id"]
        job_ids = (await light.get(f"{d.url}/v1/jobs/{group}")).json()["jobs"]
        sent = []
        await asyncio.sleep(1.0)
        # One a second, whether the last one has its first token yet or not: off, each waits for
        # a slot to free.
        while await d.redis.hget(d.keys.job(d.model, job_ids[-1]), "status") not in (b"done", b"failed"):
            sent.append(asyncio.create_task(_light(light, d)))
            await asyncio.sleep(1.0)
        probes = await asyncio.gather(*sent)
        pipe = d.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(d.keys.job(d.model, job_id), "queued_at", "started_at", "finished_at", "status")
        records = await pipe.execute()
        while any(r[3] not in (b"done", b"failed") for r in records):
            await asyncio.sleep(0.5)
            records = await pipe.execute()
        after = int(await d.redis.hget(d.keys.usage(d.model), "heavy:preemptions") or 0)
    queued = min(float(r[0]) for r in records)
    ended = max(float(r[2]) for r in records)
    return {"ttft_alone_p50_ms": round(statistics.median(alone), 1),
            "ttft_flood_p50_ms": round(statistics.median(probes), 1),
            "ttft_flood_p99_ms": round(percentile(probes, 99), 1), "ttft_flood_max_ms": round(max(probes), 1),
            "probes": len(probes),
            "flood_job_s": round(statistics.median(float(r[2]) - float(r[1]) for r in records) / 1000, 2),
            "flood_tokens_per_s": round(FLOOD * FLOOD_TOKENS / ((ended - queued) / 1000), 1),
            "preemptions": after - before}


async def measure(rounds: int) -> dict:
    overlay = {**TARGET_SETS["fast"].overlay, "LLMQ_HEARTBEAT_S": "1"}
    settings = load_settings({**os.environ, **overlay})
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import ensure_tiny_model

        ensure_tiny_model(settings.model_path)
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-preemption-")))
        deployments = list(await asyncio.gather(*(
            start_deployment(stack, name, logs, overlay, {"LLMQ_PREEMPT": preempt, "LLMQ_TENANT_HEADER": HEADER})
            for name, preempt in DEPLOYMENTS.items())))
        runs: list[dict] = []
        for r in range(rounds):
            for d in deployments[r % 2:] + deployments[:r % 2]:  # the order rotated each round
                result = await run(d)
                runs.append({"round": r, "deployment": d.name, **result})
                print(f"round {r} {d.name:15} {result}", flush=True)
    medians = []
    for name in DEPLOYMENTS:
        mine = [run for run in runs if run["deployment"] == name]
        medians.append({"deployment": name, **{field: round(statistics.median(run[field] for run in mine), 2)
                                                for field in mine[0] if field not in ("round", "deployment")}})
    return {"runs": runs, "medians": medians}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.preemption", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--out", default="bench-preemption.json")
    a = p.parse_args(argv)
    report = measured_report("preemption", "a light tenant under a flood, preemption on and off",
                             measure(a.rounds))
    rows = [[m["deployment"], m["ttft_alone_p50_ms"], m["ttft_flood_p50_ms"], m["ttft_flood_p99_ms"],
             m["ttft_flood_max_ms"], m["flood_job_s"], m["flood_tokens_per_s"], m["preemptions"]]
            for m in report["medians"]]
    save(report, a.out, markdown_table(["deployment", "light TTFT alone p50 ms", "under flood p50 ms", "p99 ms",
                                        "max ms", "flood job s", "flood tok/s", "preemptions"], rows))


if __name__ == "__main__":
    main()
