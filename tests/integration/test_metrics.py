"""``GET /metrics`` on the real app with real Redis and a worker with a scripted engine, read with
Prometheus' own parser (prometheus_client): queue gauges, the worker's pushed counters and
histograms, and the API's error counts."""

from __future__ import annotations

import asyncio

from shared.keys import Keys
from tests.support.heartbeats import beating
from tests.support.metrics import sample, samples
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import job_status

MODEL = "tiny"


async def test_metrics_count_jobs_tokens_latencies_and_refusals(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.01), max_num_seqs=1, max_queued=1,
                              heartbeat_s=0.2) as s:
        worker = s.worker.worker_id
        held = (await s.client.post("/v1/jobs", json={"prompt": "hold", "sampling": {"max_tokens": 2000}})).json()["id"]
        await job_status(s.client, held, "running")
        await asyncio.sleep(0.3)  # so its end-to-end time lands above the 0.25 s bucket
        busy = samples((await s.client.get("/metrics")).text)
        level0 = {"model": MODEL, "level": "0"}
        assert [sample(busy, g, **level0) for g in ("llmq_queue_depth", "llmq_queue_lag", "llmq_queue_pending")] == [
            1, 0, 1]
        assert 0.3 <= sample(busy, "llmq_queue_oldest_age_seconds", **level0) < 30
        refused = await s.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert refused.status_code == 429  # the one allowed unfinished job is running
        await s.client.delete(f"/v1/jobs/{held}")
        await job_status(s.client, held, "cancelled")
        for _ in range(2):
            done = await s.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        bad = await s.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400

        for _ in range(100):  # the worker pushes its figures with each heartbeat
            resp = await s.client.get("/metrics")
            values = samples(resp.text)
            if values.get(("llmq_worker_jobs_ended_total",
                           frozenset({"model": MODEL, "outcome": "done", "worker": worker}.items()))) == 2:
                break
            await asyncio.sleep(0.1)
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")

        w = {"model": MODEL, "worker": worker}
        assert sample(values, "llmq_worker_jobs_ended_total", **w, outcome="done") == 2
        assert sample(values, "llmq_worker_jobs_ended_total", **w, outcome="cancelled") == 1
        assert sample(values, "llmq_worker_jobs_started_total", **w) == 3
        assert sample(values, "llmq_worker_tokens_total", **w) >= 2 * 3 + 1  # the held job made some too
        for histogram in ("llmq_queue_wait_seconds", "llmq_ttft_seconds", "llmq_e2e_seconds"):
            assert sample(values, f"{histogram}_count", **w) == 3
            assert sample(values, f"{histogram}_bucket", **w, le="+Inf") == 3
        # The held job ran for a while before its cancel: one end-to-end time is above 0.25 s.
        assert sample(values, "llmq_e2e_seconds_bucket", **w, le="0.25") <= 2

        for gauge in ("llmq_queue_depth", "llmq_queue_lag", "llmq_queue_pending"):
            assert sample(values, gauge, **level0) == 0
        assert sample(values, "llmq_workers_ready", model=MODEL) == 1
        assert sample(values, "llmq_dead_letters", model=MODEL) == 0
        # The API's own series carry its process id: the one process in the live set.
        [api] = [a.decode() for a in await s.redis.zrange(Keys(prefix).apis(), 0, -1)]
        assert sample(values, "llmq_api_errors_total", api=api, status="429", code="overloaded") == 1
        assert sample(values, "llmq_api_errors_total", api=api, status="400", code="invalid_request") == 1
        assert sample(values, "llmq_api_streams_in_flight", api=api) == 0


async def test_each_workers_engine_layout_is_a_gauge_of_its_ranks(redis_url, prefix):
    """One series per worker, its layout in the labels and its ranks (tensor × pipeline) the value:
    the scripted worker's one, and a worker of 8 × 2 ranks over two hosts, as its heartbeat says
    (loading: its layout shows before its engine is up)."""
    async with scripted_stack(redis_url, prefix, ScriptedEngine(), heartbeat_s=0.2) as s, \
            beating(s.redis, prefix, "w-big", "big", tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2):
        text = (await s.client.get("/metrics")).text
    assert [line for line in text.splitlines() if "llmq_worker_ranks" in line] == [
        "# HELP llmq_worker_ranks Ranks of the worker's engine (tensor x pipeline, over its nodes), its layout in the "
        "labels.",
        "# TYPE llmq_worker_ranks gauge",
        'llmq_worker_ranks{model="big",tensor="8",pipeline="2",nodes="2",worker="w-big"} 16',
        f'llmq_worker_ranks{{model="{MODEL}",tensor="1",pipeline="1",nodes="1",worker="{s.worker.worker_id}"}} 1']
    # As Prometheus reads it.
    assert sample(samples(text), "llmq_worker_ranks", model="big", tensor="8", pipeline="2", nodes="2",
                  worker="w-big") == 16
