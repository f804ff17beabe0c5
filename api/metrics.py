"""``GET /metrics``: the whole deployment in Prometheus' text format, from any API process.

Queue gauges and per-tenant series (:func:`tenant_series`) are read from Redis at scrape time, the
workers' counters and histograms come from their heartbeats (``shared/metrics.py`` says which
figure comes from where), and so do the API processes' own series (error answers by status and
code, the streams each relays), labelled ``api=<process id>``: each process pushes them every
LLMQ_HEARTBEAT_S (:func:`publish`), so a scrape that lands on any of N web processes behind one
port sees all N. The answering process adds its own figures as they are now.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import structlog
from litestar import Litestar, Response, get
from redis.asyncio import Redis

from api.operations import TEXT, documented
from api.services import Services, Svc
from shared.errors import HttpError, ServiceError, UnknownError
from shared.keys import LEVELS, Keys
from shared.metrics import Sample, decode_samples, encode_samples, exposition
from shared.queue import now_ms
from shared.redis import REDIS_DOWN
from shared.status import snapshot

__all__ = ["metrics", "collect", "pushing", "tenant_series", "OTHER"]

log = structlog.get_logger()

# Prometheus' text format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OTHER = "other"
"""The ``tenant`` label every tenant past the first LLMQ_METRICS_TENANTS of a model is summed under."""

# A usage hash's figure (field ``<tenant>:<figure>``, shared/tenants.py) -> (counter, divisor to its unit).
_COUNTERS = {"requests": ("llmq_tenant_requests_total", 1), "prompt_tokens": ("llmq_tenant_prompt_tokens_total", 1),
             "generated_tokens": ("llmq_tenant_generated_tokens_total", 1),
             "engine_ms": ("llmq_tenant_engine_seconds_total", 1000),
             "preemptions": ("llmq_tenant_preemptions_total", 1),
             "preempted_ms": ("llmq_tenant_preempted_seconds_total", 1000)}


async def tenant_series(redis: Redis, keys: Keys, model: str, cap: int) -> list[Sample]:
    """The model's per-tenant counters (from its usage since the start) and, for the labelled
    tenants only, their jobs waiting and running. Two pipelines (the second needs the first's
    tenant names), of a size bounded by ``cap`` bar the usage hash, which is read whole: the
    unlabelled tenants' sum needs every one of them."""
    cap = max(0, cap)
    pipe = redis.pipeline(transaction=False)
    # The usage first, the tenants after: a tenant enters the first-seen set when it queues its
    # first job, before any of its jobs can end, so every tenant whose usage this reads is in the
    # set read after it (with no transaction, which Redis Cluster clients cannot pipeline).
    pipe.hgetall(keys.usage(model))
    pipe.zrange(keys.tenants(model), 0, cap)  # one more than the cap: see "other" below
    pipe.zcard(keys.tenants(model))
    usage, first, seen = await pipe.execute()
    # Labels go to the first tenants to queue a job (first-seen order, which never changes: ZADD NX
    # and nothing removes one), not to the busiest: a labelled tenant stays labelled and "other"
    # only ever gains tenants, so every counter only grows. By volume, a tenant would move in and
    # out of "other" and both series would drop, which Prometheus reads as counter resets. A tenant
    # really named "other" is summed there too, so that no series stands for two things.
    labelled = [t for t in (name.decode() for name in first) if t != OTHER][:cap]
    totals = {t: dict.fromkeys(_COUNTERS, 0) for t in labelled}
    if seen > len(labelled):  # some tenant has no label of its own: "other" exists from then on
        totals[OTHER] = dict.fromkeys(_COUNTERS, 0)
    for field, value in usage.items():
        tenant, _, name = field.decode().rpartition(":")
        row = totals.get(tenant, totals.get(OTHER))
        if row is not None and name in row:
            row[name] += int(value)
    out = [Sample(counter, {"model": model, "tenant": tenant}, row[field] / divisor)
           for tenant, row in totals.items() for field, (counter, divisor) in _COUNTERS.items()]
    if not labelled:
        return out
    pipe = redis.pipeline(transaction=False)
    for tenant in labelled:
        for level in range(LEVELS):
            pipe.zcard(keys.tenant_waiting(model, tenant, level))
        pipe.scard(keys.tenant_running(model, tenant))
    replies = await pipe.execute()
    for i, tenant in enumerate(labelled):
        *waiting, running = replies[i * (LEVELS + 1):(i + 1) * (LEVELS + 1)]
        labels = {"model": model, "tenant": tenant}
        out += [Sample("llmq_tenant_waiting_jobs", labels, sum(waiting)),
                Sample("llmq_tenant_running_jobs", labels, running)]
    return out


_AFFINITY = ("hit", "miss", "wait")


async def affinity_series(redis: Redis, keys: Keys, models: list[str]) -> list[Sample]:
    """Each model's affinity counters (shared/lua/read.lua keeps them: ``Keys.affinity``), from 0."""
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.hmget(keys.affinity(model), [f"{outcome}s" for outcome in _AFFINITY])
    return [Sample("llmq_affinity_picks_total", {"model": model, "outcome": outcome}, int(value or 0))
            for model, values in zip(models, await pipe.execute(), strict=True)
            for outcome, value in zip(_AFFINITY, values, strict=True)]


async def collect(svc: Services) -> list[Sample]:
    # tenant_series reads every tenant's figures; the affinity holders are llmq-status's (a SCAN).
    status = await snapshot(svc.queue.redis, svc.keys, top=0, held=False)
    out: list[Sample] = []
    for m in status.models:
        for lv in m.levels:
            labels = {"model": m.name, "level": str(lv.level)}
            out += [Sample("llmq_queue_depth", labels, lv.waiting + lv.running),
                    Sample("llmq_queue_lag", labels, lv.waiting), Sample("llmq_queue_pending", labels, lv.running),
                    # An empty level's oldest job is 0 s old: the series exists while nothing waits.
                    Sample("llmq_queue_oldest_age_seconds", labels, lv.oldest_age_s or 0)]
        out += [Sample("llmq_dead_letters", {"model": m.name}, m.dead_letters),
                Sample("llmq_workers_ready", {"model": m.name}, m.ready_workers)]
    per_model = await asyncio.gather(*(tenant_series(svc.queue.redis, svc.keys, m.name, svc.settings.metrics_tenants)
                                       for m in status.models))
    out += [sample for samples in per_model for sample in samples]
    out += await affinity_series(svc.queue.redis, svc.keys, [m.name for m in status.models])
    for w in status.workers:
        out += [Sample(s.name, {**s.labels, "worker": w.id}, s.value) for s in w.metrics]
        # Its engine's layout, from the heartbeat's field (as llmq-status and /v1/deployment show
        # it): the layout in the labels, its ranks as the value, so a sum by model is the devices
        # (GPUs, or CPU shares) the model's engines hold.
        p = w.parallel
        out.append(Sample("llmq_worker_ranks", {"model": w.model, "tensor": str(p.tensor), "pipeline": str(p.pipeline),
                                                "nodes": str(p.nodes), "worker": w.id}, p.tensor * p.pipeline))
    out += _own(svc)
    out += await _peers(svc)
    return out


@functools.cache
def _no_errors() -> dict[tuple[int, str], int]:
    """Every error answer known in advance, at 0: each error class's own status and code (a
    dialect that answers one with another status, or an error whose status is per instance, adds
    its series when it first happens)."""
    def classes(cls: type[ServiceError]) -> list[type[ServiceError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in classes(sub))]
    return {(cls.status, cls.code): 0 for cls in classes(ServiceError)
            if cls not in (UnknownError, HttpError)}


def _own(svc: Services) -> list[Sample]:
    """This process's own series, labelled with its id; its error answers from 0."""
    api = {"api": svc.instance}
    errors = {**_no_errors(), **svc.errors}
    return [Sample("llmq_api_streams_in_flight", api, svc.listener.channels),
            *(Sample("llmq_api_errors_total", {**api, "status": str(status_code), "code": code}, n)
              for (status_code, code), n in sorted(errors.items()))]


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


@documented("Prometheus metrics: queues, workers, latencies", "health", ok={200: (TEXT,)})
@get("/metrics", opt={"dialect": "jobs"})
async def metrics(svc: Svc) -> Response:
    return Response(exposition(await collect(svc)), media_type=CONTENT_TYPE)
