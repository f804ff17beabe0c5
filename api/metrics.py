"""``GET /metrics``: the deployment in Prometheus' text format, as one API process sees it.

Queue gauges are read from Redis at scrape time, the workers' counters and histograms come from
their heartbeats (``shared/metrics.py`` says which figure comes from where), and this process
adds its own: error answers by status and code, and the streams it is relaying.
"""

from __future__ import annotations

from litestar import Response, get

from api.services import Services, Svc
from shared.metrics import Sample, exposition
from shared.status import snapshot

__all__ = ["metrics", "collect"]

# Prometheus' text format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def collect(svc: Services) -> list[Sample]:
    status = await snapshot(svc.queue.redis, svc.keys)
    out: list[Sample] = []
    for m in status.models:
        for lv in m.levels:
            labels = {"model": m.name, "level": str(lv.level)}
            out += [Sample("llmq_queue_depth", labels, lv.waiting + lv.running),
                    Sample("llmq_queue_lag", labels, lv.waiting), Sample("llmq_queue_pending", labels, lv.running)]
            if lv.oldest_age_s is not None:
                out.append(Sample("llmq_queue_oldest_age_seconds", labels, lv.oldest_age_s))
        out += [Sample("llmq_dead_letters", {"model": m.name}, m.dead_letters),
                Sample("llmq_workers_ready", {"model": m.name}, m.ready_workers)]
    for w in status.workers:
        out += [Sample(s.name, {**s.labels, "worker": w.id}, s.value) for s in w.metrics]
    out.append(Sample("llmq_api_streams_in_flight", {}, svc.listener.channels))
    out += [Sample("llmq_api_errors_total", {"status": str(status_code), "code": code}, n)
            for (status_code, code), n in sorted(svc.errors.items())]
    return out


@get("/metrics", opt={"dialect": "jobs"})
async def metrics(svc: Svc) -> Response:
    return Response(exposition(await collect(svc)), media_type=CONTENT_TYPE)
