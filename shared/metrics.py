"""Prometheus metrics: one catalogue, the workers' recorder, and the text exposition.

Where each figure comes from:

- queue gauges (depth, the group's lag and pending entries, the oldest job's age, dead letters,
  ready workers) are read from Redis when ``/metrics`` is scraped: one pipeline per model
  (``shared.inspection.read_queue``, through ``shared.status.snapshot``);
- per-tenant counters (requests, prompt and generated tokens, engine time) are read at scrape time
  from each model's usage-since-the-start hash, which the scripts that end jobs keep (tenants.lua),
  and the per-tenant gauges (jobs waiting, running) from the scheduler's per-tenant lists and sets.
  At most LLMQ_METRICS_TENANTS tenants per model get a ``tenant`` label, the first to queue a job
  there; the rest are summed under ``tenant="other"`` (``api/metrics.py`` says why). Two
  pipelines per model, whatever the number of tenants (the usage hash is read whole: its size
  grows with them);
- each worker counts its jobs, tokens, reclaims and outcomes and keeps the latency histograms,
  and pushes them through Redis: one JSON field of its heartbeat hash, rewritten every beat. The
  API serves them with a ``worker`` label. No port per worker: a worker on any host is scraped
  through the one API, and its figures vanish with its heartbeat key. Its engine's layout (the
  heartbeat's ``parallel``) is served from there too, as one gauge per worker;
- the API counts what only it sees (error answers such as 429s, streams in flight).

Every family is declared from the first scrape, and every series known in advance starts at 0
(a worker's counters and histograms, the API's error answers by each error's own status and code,
an empty level's oldest age), so a new deployment's dashboard shows 0 rather than no data.

The workers' and API processes' counters are per process, so they restart at 0 with the process;
Prometheus' ``rate()`` reads a reset as one. The per-tenant counters live in Redis and only grow.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import NamedTuple

import msgspec

__all__ = ["CATALOGUE", "BUCKETS", "Sample", "Recorder", "exposition", "encode_samples", "decode_samples"]

# Seconds; from a queue pickup (milliseconds) to a long generation (minutes).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metric(NamedTuple):
    kind: str  # gauge, counter or histogram
    help: str


CATALOGUE: dict[str, Metric] = {
    "llmq_queue_depth": Metric("gauge", "Unfinished jobs on the level: lag + pending (finished entries are deleted)."),
    "llmq_queue_lag": Metric("gauge", "Jobs queued and not yet delivered to any worker (waiting their tenant's turn)."),
    "llmq_queue_pending": Metric("gauge", "Jobs delivered to a worker and unfinished (the group's pending entries)."),
    "llmq_queue_oldest_age_seconds": Metric("gauge", "Age of the oldest unfinished job on the level (0: none)."),
    "llmq_dead_letters": Metric("gauge", "Records in the model's dead-letter stream."),
    "llmq_workers_ready": Metric("gauge", "Warm workers serving the model."),
    "llmq_worker_ranks": Metric("gauge", "Ranks of the worker's engine (tensor x pipeline, over its nodes), its layout "
                                         "in the labels."),
    "llmq_tenant_requests_total": Metric("counter", "Jobs of the tenant that ended on the model, however they ended."),
    "llmq_tenant_prompt_tokens_total": Metric("counter", "Prompt tokens of the tenant's jobs that ended on the model."),
    "llmq_tenant_generated_tokens_total": Metric("counter",
                                                 "Tokens generated for the tenant's jobs that ended on the model."),
    "llmq_tenant_engine_seconds_total": Metric("counter", "Engine time of the tenant's jobs, from start to end."),
    "llmq_tenant_waiting_jobs": Metric("gauge", "The tenant's jobs waiting for its turn (every level)."),
    "llmq_tenant_running_jobs": Metric("gauge", "The tenant's jobs picked and not yet ended."),
    "llmq_api_streams_in_flight": Metric("gauge", "Jobs an API process (label api) is relaying to clients right now."),
    "llmq_api_errors_total": Metric("counter",
                                    "Requests an API process (label api) refused or failed, by status and code."),
    "llmq_worker_jobs_started_total": Metric("counter", "Jobs the worker started in its engine."),
    "llmq_worker_jobs_reclaimed_total": Metric("counter", "Jobs the worker took over after their lease lapsed."),
    "llmq_worker_jobs_ended_total": Metric("counter", "Jobs the worker ended, by outcome (done or an error code)."),
    "llmq_worker_tokens_total": Metric("counter", "Tokens the worker generated."),
    "llmq_worker_pooled_inputs_total": Metric("counter", "Inputs the worker pooled: embeddings made, pairs scored."),
    "llmq_worker_preemptions_total": Metric("counter", "Running jobs the worker handed back for a waiting job owed "
                                                       "their slot."),
    "llmq_tenant_preemptions_total": Metric("counter", "The tenant's jobs that gave their slot to a job owed it, "
                                                       "counted when they end."),
    "llmq_tenant_preempted_seconds_total": Metric("counter", "The time the tenant's preempted jobs waited again."),
    "llmq_worker_engine_deaths_total": Metric("counter", "Times the worker's engine died; each was rebuilt in "
                                                         "place until LLMQ_ENGINE_RESTARTS in the window."),
    "llmq_worker_adapter_loads_total": Metric("counter", "LoRA adapters the worker's engine loaded."),
    "llmq_worker_adapter_evictions_total": Metric("counter",
                                                  "LoRA adapters the worker's engine evicted to load another."),
    "llmq_affinity_picks_total": Metric("counter", "Jobs picked by their prefix or adapter holder (outcome hit), "
                                                   "by another once their wait was over (miss), and picks that left a "
                                                   "job for its holder (wait)."),
    "llmq_queue_wait_seconds": Metric("histogram", "From enqueue to the job's start on a worker."),
    "llmq_ttft_seconds": Metric("histogram", "From enqueue to the job's first token."),
    "llmq_ttft_predicted_seconds": Metric("histogram", "The time to first token admission predicted for the job "
                                                       "(docs/guarantees.md#slos), observed at its first token."),
    "llmq_ttft_prediction_error_seconds": Metric("histogram", "How far the job's first token came from the "
                                                              "predicted time, either way."),
    "llmq_ttft_predictions_total": Metric("counter", "Predicted jobs whose first token came later than predicted "
                                                     "(direction late) or no later (early)."),
    "llmq_e2e_seconds": Metric("histogram", "From enqueue to the job's end."),
}


WORKER_ZEROS: tuple[tuple[str, dict[str, str]], ...] = (
    ("llmq_worker_jobs_started_total", {}), ("llmq_worker_jobs_reclaimed_total", {}),
    ("llmq_worker_jobs_ended_total", {"outcome": "done"}), ("llmq_worker_tokens_total", {}),
    ("llmq_worker_pooled_inputs_total", {}),
    ("llmq_worker_adapter_loads_total", {}), ("llmq_worker_adapter_evictions_total", {}),
    ("llmq_worker_preemptions_total", {}), ("llmq_worker_engine_deaths_total", {}))
"""A worker's counters as they start: at 0, so each series exists from its first heartbeat on
(Prometheus' advice for series known in advance; an error outcome is not: it appears with its
first job)."""


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class _Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value
        self.n += 1

    def samples(self, name: str, labels: dict[str, str]) -> list[Sample]:
        out, running = [], 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(Sample(f"{name}_bucket", {**labels, "le": _number(bound)}, running))
        return [*out, Sample(f"{name}_sum", labels, self.total), Sample(f"{name}_count", labels, self.n)]


class Recorder:
    """A worker's counters and histograms, all labelled with its model; the counters of
    :data:`WORKER_ZEROS` and every histogram (empty) are there from the start."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._histograms = {name: _Histogram() for name, metric in CATALOGUE.items() if metric.kind == "histogram"}
        for name, labels in WORKER_ZEROS:
            self.inc(name, 0, **labels)

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        assert CATALOGUE[name].kind == "counter", name
        key = (name, tuple(sorted(labels.items())) if labels else ())  # unlabelled: once per step, keep it cheap
        self._counters[key] = self._counters.get(key, 0) + amount

    def set_total(self, name: str, value: float) -> None:
        """A counter kept elsewhere (the engine's adapter loads), at its current total."""
        assert CATALOGUE[name].kind == "counter", name
        self._counters[(name, ())] = value

    def observe(self, name: str, seconds: float) -> None:
        assert CATALOGUE[name].kind == "histogram", name
        self._histograms[name].observe(max(0.0, seconds))

    def samples(self) -> list[Sample]:
        base = {"model": self.model}
        out = [Sample(name, {**base, **dict(labels)}, value) for (name, labels), value in self._counters.items()]
        for name, histogram in self._histograms.items():
            out += histogram.samples(name, base)
        return out


def encode_samples(samples: Iterable[Sample]) -> bytes:
    return msgspec.json.encode([[s.name, s.labels, s.value] for s in samples])


def decode_samples(raw: bytes | str) -> list[Sample]:
    return [Sample(name, labels, value) for name, labels, value in msgspec.json.decode(raw)]


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and CATALOGUE.get(base, Metric("", "")).kind == "histogram":
            return base
    return name


def exposition(samples: Iterable[Sample]) -> str:
    """Prometheus' text format (0.0.4): each family's HELP and TYPE once, then its samples. Every
    family of the catalogue is declared, with or without samples, so a scrape names them all from
    the first one on (a family whose labels have no value yet, such as a tenant's, has none)."""
    families: dict[str, list[Sample]] = {name: [] for name in CATALOGUE}
    for sample in samples:
        families.setdefault(_family(sample.name), []).append(sample)
    lines = []
    for family in sorted(families, key=lambda f: list(CATALOGUE).index(f) if f in CATALOGUE else len(CATALOGUE)):
        metric = CATALOGUE.get(family, Metric("untyped", ""))
        lines += [f"# HELP {family} {metric.help}", f"# TYPE {family} {metric.kind}"]
        for s in families[family]:
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in s.labels.items())
            lines.append(f"{s.name}{{{labels}}} {_number(s.value)}" if labels else f"{s.name} {_number(s.value)}")
    return "\n".join(lines) + "\n"
