"""``GET /metrics``: the whole deployment in Prometheus' text format, from any API process.

Queue gauges are read from Redis at scrape time, the workers' counters and histograms come from
their heartbeats (``shared/metrics.py`` says which figure comes from where), and so do the API
processes' own series (error answers by status and code, the streams each relays), labelled
``api=<process id>``: each process pushes them every LLMQ_HEARTBEAT_S (:func:`publish`), so a
scrape that lands on any of N web processes behind one port sees all N. The answering process
adds its own figures as they are now.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from litestar import Litestar, Response, get

from api.services import Services, Svc
from shared.metrics import Sample, decode_samples, encode_samples, exposition
from shared.queue import now_ms
from shared.redis import REDIS_DOWN
from shared.status import snapshot

__all__ = ["metrics", "collect", "pushing"]

log = structlog.get_logger()

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
    out += _own(svc)
    out += await _peers(svc)
    return out


def _own(svc: Services) -> list[Sample]:
    """This process's own series, labelled with its id."""
    api = {"api": svc.instance}
    return [Sample("llmq_api_streams_in_flight", api, svc.listener.channels),
            *(Sample("llmq_api_errors_total", {**api, "status": str(status_code), "code": code}, n)
              for (status_code, code), n in sorted(svc.errors.items()))]


async def _peers(svc: Services) -> list[Sample]:
    """The other live API processes' series, as each last pushed them."""
    redis, keys = svc.queue.redis, svc.keys
    peers = [p.decode() for p in await redis.zrangebyscore(keys.apis(), now_ms(), "+inf")]
    peers = [p for p in peers if p != svc.instance]
    if not peers:
        return []
    pushed = await asyncio.gather(*(redis.get(keys.api_metrics(p)) for p in peers))
    return [sample for raw in pushed if raw for sample in decode_samples(raw)]


async def publish(svc: Services, every_s: float) -> None:
    """Push this process's series every ``every_s`` until cancelled; each push lives three
    periods, so a process that died leaves the scrape within them."""
    redis, keys = svc.queue.redis, svc.keys
    ttl_ms = int(every_s * 3 * 1000)
    while True:
        try:
            pipe = redis.pipeline(transaction=False)
            pipe.set(keys.api_metrics(svc.instance), encode_samples(_own(svc)), px=ttl_ms)
            pipe.zadd(keys.apis(), {svc.instance: now_ms() + ttl_ms})
            pipe.zremrangebyscore(keys.apis(), 0, now_ms())
            await pipe.execute()
        except REDIS_DOWN as exc:  # the next push tells the truth again; the scrape says Redis is down
            log.debug("api_metrics_push_failed", error=str(exc))
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def pushing(app: Litestar) -> AsyncIterator[None]:
    """The app's lifespan part that pushes this process's series (after the services' lifespan,
    whose Redis client it uses: Litestar leaves lifespans in reverse order)."""
    svc: Services = app.state.services
    task = asyncio.create_task(publish(svc, svc.settings.heartbeat_s), name="api-metrics")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await withdraw(svc)


async def withdraw(svc: Services) -> None:
    """This process's series out of every scrape (a clean shutdown)."""
    try:
        await svc.queue.redis.zrem(svc.keys.apis(), svc.instance)
        await svc.queue.redis.delete(svc.keys.api_metrics(svc.instance))
    except REDIS_DOWN:
        pass  # they expire by themselves


@get("/metrics", opt={"dialect": "jobs"})
async def metrics(svc: Svc) -> Response:
    return Response(exposition(await collect(svc)), media_type=CONTENT_TYPE)
