"""``llmq-status`` (``python -m shared.status``): what the queue holds right now, read from Redis.

The friendly face of the redis-cli recipes in docs/redis.md. Per model and priority level: jobs waiting
(queued, not yet delivered), running (delivered and unfinished: the consumer group's pending
entries) and the oldest unfinished job's age; the dead-letter count; and every worker's heartbeat
(model, status, slots, running, device, its engine's layout, last beat); per model, the top tenants
of the day (UTC) by tokens, with their requests, prompt and generated tokens and engine time.
``--json`` prints the same as one JSON document.

Everything is read, nothing written, so it is safe against a live deployment. The queue's figures
come from ``shared.inspection.read_queue`` (one pipeline per model), as /metrics' and the sweep's do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import TypeVar

import msgspec
from redis.asyncio import Redis

from shared.config import Settings, load_settings
from shared.inspection import read_queue
from shared.keys import Keys
from shared.media import ModelInfo
from shared.metrics import Sample, decode_samples
from shared.redis import connect, reply
from shared.registry import Registry
from shared.slo import Rates
from shared.tenants import today, top_tenants

__all__ = ["Status", "ModelStatus", "LevelStatus", "TenantUsage", "WorkerStatus", "Held", "snapshot", "render",
           "main"]

TOP_TENANTS = 5


class LevelStatus(msgspec.Struct, kw_only=True):
    level: int
    stream: str
    waiting: int
    """Queued and not yet delivered to any worker."""
    running: int
    """Delivered and unfinished (the group's pending entries; a dead worker's until reclaimed)."""
    oldest_age_s: float | None
    """Age of the oldest unfinished job on this level (a stream entry id is its enqueue time)."""


class Parallel(msgspec.Struct, kw_only=True, frozen=True):
    """How a worker's engine is laid out (docs/operations.md#sizing): its ranks are tensor × pipeline,
    over ``nodes`` hosts; the queue sees one worker with one set of slots, whatever its size."""

    tensor: int = 1
    pipeline: int = 1
    nodes: int = 1

    @classmethod
    def of(cls, settings: Settings) -> Parallel:
        return cls(tensor=settings.tensor_parallel_size, pipeline=settings.pipeline_parallel_size,
                   nodes=settings.nnodes)


_model_info = msgspec.json.Decoder(ModelInfo)


class WorkerStatus(msgspec.Struct, kw_only=True):
    id: str
    model: str
    kind: str = "generate"
    """What its model does: a pooling worker's is ``embed`` or ``rerank`` (its jobs are embeddings or scores)."""
    status: str  # warming, ready, draining
    slots: int
    running: int
    host: str
    pid: int
    device: str = ""
    """The GPU(s) or CPU share it claimed on its host (``gpu:1``, ``cpu:0 cpus=0-7``)."""
    devices: list[str] = []
    """Its engine's devices on its host, one per rank there (``["gpu:0", "gpu:1"]``, ``["cpu:0", "cpu:1"]``)."""
    parallel: Parallel = Parallel()
    """Its engine's layout: tensor × pipeline ranks over ``nodes`` hosts."""
    last_heartbeat_age_s: float
    adapters: list[str] = []
    """The LoRA adapters its engine holds (docs/adapters.md): jobs for them are its first."""
    metrics: list[Sample] = []
    """Its Prometheus counters and histograms (shared/metrics.py), as of its last heartbeat."""
    rates: Rates = msgspec.field(default_factory=Rates)  # Rates is mutable: one per worker
    """Its measured prefill and decode rates (workers/rates.py); zeros until it measured them,
    and from a worker older than them."""


class TenantUsage(msgspec.Struct, kw_only=True):
    """One tenant's usage of one model on the status' day (UTC), from jobs that ended."""

    tenant: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    engine_seconds: float
    preemptions: int = 0
    """Its jobs that gave their slot to a job owed it (docs/tenants.md#preemption)."""
    preempted_seconds: float = 0.0


class Held(msgspec.Struct, kw_only=True):
    """What one worker holds for the pick's affinity (docs/adapters.md#affinity): its holder keys."""

    worker: str
    prefixes: int
    """Conversation prefix keys whose last job it started."""
    adapters: list[str]
    """Adapters whose last job it started."""


class ModelStatus(msgspec.Struct, kw_only=True):
    name: str
    kind: str = "generate"
    """What it does (``generate``, ``embed``, ``rerank``), as its workers last reported it."""
    waiting: int
    running: int
    dead_letters: int
    ready_workers: int
    levels: list[LevelStatus]
    top_tenants: list[TenantUsage] = []
    """The tenants that used the most tokens (prompt + generated) on the day, most first."""
    held: list[Held] = []
    """Per worker, the affinity keys it holds (read by a SCAN: an operator's view, not /metrics')."""


class Status(msgspec.Struct, kw_only=True):
    prefix: str
    at: float
    """Epoch seconds of the reading."""
    models: list[ModelStatus]
    workers: list[WorkerStatus]
    day: str = ""
    """The UTC day the models' top tenants are counted over (the reading's)."""


def _age_s(at_ms: int, now: float) -> float:
    return round(max(0.0, now - at_ms / 1000), 3)


async def _model(redis: Redis, keys: Keys, name: str, now: float, top: int, held: bool) -> ModelStatus:
    reading = await read_queue(redis, keys, name, now_ms=now * 1000)
    ranked = await top_tenants(redis, keys, name, today(now), top) if top > 0 else []
    levels = [LevelStatus(level=lv.level, stream=lv.stream, waiting=lv.waiting, running=lv.pending,
                          oldest_age_s=None if lv.oldest_ms is None else _age_s(lv.oldest_ms, now))
              for lv in reading.levels if lv.exists]
    info = await reply(redis.hget(keys.model_info(), name))
    return ModelStatus(
        name=name, kind=_model_info.decode(info).kind if info else "generate",
        waiting=sum(lv.waiting for lv in levels), running=sum(lv.running for lv in levels),
        held=await _held(redis, keys, name) if held else [],
        dead_letters=reading.dead_letters, ready_workers=reading.ready_workers, levels=levels,
        top_tenants=[TenantUsage(tenant=tenant, requests=u.get("requests", 0), prompt_tokens=u.get("prompt_tokens", 0),
                                 generated_tokens=u.get("generated_tokens", 0),
                                 engine_seconds=u.get("engine_ms", 0) / 1000, preemptions=u.get("preemptions", 0),
                                 preempted_seconds=u.get("preempted_ms", 0) / 1000) for tenant, u in ranked],
    )


async def _held(redis: Redis, keys: Keys, model: str) -> list[Held]:
    prefix = keys.holder(model, "")
    names = [key async for key in redis.scan_iter(match=keys.holder(model, "*"), count=1000)]
    workers = await redis.mget(names) if names else []
    held: dict[str, Held] = {}
    for key, worker in zip(names, workers, strict=True):
        if worker is None:  # expired between the scan and the read
            continue
        row = held.setdefault(worker.decode(), Held(worker=worker.decode(), prefixes=0, adapters=[]))
        kind, _, name = key.decode().removeprefix(prefix).partition(":")
        if kind == "a":
            row.adapters.append(name)
        else:
            row.prefixes += 1
    return [msgspec.structs.replace(h, adapters=sorted(h.adapters)) for _, h in sorted(held.items())]


_T = TypeVar("_T")


def _json(raw: dict[str, str], field: str, kind: type[_T], default: _T) -> _T:
    """A heartbeat field the worker writes as JSON (``default``: absent, from an older worker)."""
    return msgspec.json.decode(raw[field], type=kind) if field in raw else default


async def _workers(redis: Redis, keys: Keys, now: float) -> list[WorkerStatus]:
    workers = []
    async for worker_id, raw in Registry(redis, keys).heartbeats():
        workers.append(WorkerStatus(
            id=worker_id, model=raw.get("model", "?"), status=raw.get("status", "?"),
            slots=int(raw.get("slots", 0)), running=int(raw.get("running", 0)), host=raw.get("host", "?"),
            pid=int(raw.get("pid", 0)), device=raw.get("device", ""),
            devices=_json(raw, "devices", list[str], []),
            parallel=_json(raw, "parallel", Parallel, Parallel()),
            last_heartbeat_age_s=round(max(0.0, now - float(raw.get("last_heartbeat", 0)) / 1000), 3),
            adapters=_json(raw, "adapters", list[str], []),
            rates=_json(raw, "rates", Rates, Rates()),
            metrics=decode_samples(raw["metrics"]) if "metrics" in raw else [],
        ))
    return sorted(workers, key=lambda w: (w.model, w.id))


async def snapshot(redis: Redis, keys: Keys, *, top: int = TOP_TENANTS, held: bool = True,
                   models: list[str] | None = None) -> Status:
    """One reading of ``models`` (default: every model any worker ever advertised), with its
    ``top`` tenants of the day (0: none read) and, with ``held``, its affinity holders (a SCAN),
    and of every live worker."""
    now = time.time()
    names = models if models is not None else sorted(n.decode() for n in await redis.zrange(keys.models(), 0, -1))
    read = [await _model(redis, keys, n, now, top, held) for n in names]
    kinds = {m.name: m.kind for m in read}
    workers = [msgspec.structs.replace(w, kind=kinds.get(w.model, w.kind)) for w in await _workers(redis, keys, now)]
    return Status(prefix=keys.prefix, at=round(now, 3), day=today(now), models=read, workers=workers)


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    cells = [header, *[["-" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def _layout(p: Parallel) -> str:
    """A worker's engine layout in vLLM's terms (``tp=2``, ``tp=2 pp=2``, ``tp=8 pp=2 nodes=2``): the
    tensor size always, so a one-device worker reads ``tp=1``; pipeline and hosts only past 1."""
    return " ".join([f"tp={p.tensor}", *([f"pp={p.pipeline}"] if p.pipeline > 1 else []),
                     *([f"nodes={p.nodes}"] if p.nodes > 1 else [])])


def render(status: Status) -> str:
    lines = [f"llmq status, prefix {status.prefix}, at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(status.at))}Z"]
    if not status.models:
        lines.append("no model has been served under this prefix")
    for m in status.models:
        kind = "" if m.kind == "generate" else f" ({m.kind})"
        lines += ["", f"model {m.name}{kind}: {m.waiting} waiting, {m.running} running, "
                      f"{m.dead_letters} dead-lettered, {m.ready_workers} ready worker(s)"]
        lines += _table(["level", "stream", "waiting", "running", "oldest (s)"],
                        [[lv.level, lv.stream, lv.waiting, lv.running, lv.oldest_age_s] for lv in m.levels])
        if m.held:
            lines += ["", "  affinity holders (docs/adapters.md#affinity):"]
            lines += _table(["worker", "prefixes", "adapters"],
                            [[h.worker, h.prefixes, ", ".join(h.adapters) or None] for h in m.held])
        if m.top_tenants:
            lines += ["", f"  top tenants of {status.day} (UTC), by tokens:"]
            lines += _table(["tenant", "requests", "prompt tokens", "generated tokens", "engine (s)", "preemptions",
                             "waited again (s)"],
                            [[t.tenant, t.requests, t.prompt_tokens, t.generated_tokens, round(t.engine_seconds, 3),
                              t.preemptions, round(t.preempted_seconds, 3)] for t in m.top_tenants])
    lines += ["", f"workers: {len(status.workers)}"]
    if status.workers:
        lines += _table(["id", "model", "kind", "status", "slots", "running", "host", "pid", "device", "layout",
                         "last beat (s ago)", "adapters"],
                        [[w.id, w.model, w.kind, w.status, w.slots, w.running, w.host, w.pid, w.device or None,
                          _layout(w.parallel), w.last_heartbeat_age_s, ", ".join(w.adapters) or None]
                         for w in status.workers])
    return "\n".join(lines)


async def _run(url: str, prefix: str, as_json: bool) -> str:
    redis = connect(url)
    try:
        status = await snapshot(redis, Keys(prefix))
    finally:
        await redis.aclose()
    return msgspec.json.format(msgspec.json.encode(status)).decode() if as_json else render(status)


def main(argv: list[str] | None = None) -> None:
    settings = load_settings()
    p = argparse.ArgumentParser(prog="llmq-status", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=settings.redis_dsn, help="Redis URL (default: LLMQ_REDIS_URL, as the services)")
    p.add_argument("--prefix", default=settings.prefix, help="key prefix (default: LLMQ_PREFIX)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    sys.stdout.write(asyncio.run(_run(args.url, args.prefix, args.json)) + "\n")


if __name__ == "__main__":
    main()
