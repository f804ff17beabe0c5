"""The JSON shapes of llmq's own routes, the ones that speak no client's dialect: what the
console's and scripts' views (api/routes/overview.py), the usage page, the health probes and the
LoRA adapter routes answer and read.

A dialect's shapes live with its translation (api/dialects/); these have none, so they live here,
apart from the handlers that fill them, where the OpenAPI document can name them without
importing a route (api/openapi.py renders them with ``msgspec.json.schema_components``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from shared import browse
from shared.schemas import GenerationRequest, JobError, JobRecord, Run
from shared.slo import Standing
from shared.status import WorkerStatus
from shared.tenants import UsageRow

__all__ = [
    "AccessView",
    "DeadLetterDeleted",
    "DeadLetterList",
    "DeploymentView",
    "JobList",
    "LevelView",
    "Liveness",
    "LoadAdapter",
    "ModelView",
    "Ping",
    "Readiness",
    "RecordView",
    "RequeueView",
    "TenantList",
    "UnloadAdapter",
    "UsagePage",
]


# The console's and scripts' views of the deployment (GET /v1/access, /v1/deployment, ...)
class AccessView(msgspec.Struct, kw_only=True):
    object: str = "access"
    role: Literal["operator", "tenant"]
    tenant: str
    keys: bool
    """Keys are configured; false: every (loopback) caller is an operator."""


class LevelView(msgspec.Struct, kw_only=True):
    level: int
    waiting: int
    running: int
    oldest_age_s: float | None
    finished_per_min: float | None
    """Jobs that ended there per minute, over about the last minute (None: no sample that old)."""


class ModelView(msgspec.Struct, kw_only=True):
    name: str
    kind: str = "generate"
    """What it does: ``generate``, or a pooling model's ``embed`` or ``rerank``."""
    ready_workers: int
    loading_workers: int
    slots: int
    """Engine slots of its ready workers."""
    slots_in_use: int
    waiting: int
    running: int
    dead_letters: int
    adapters: list[str]
    """LoRA adapters some worker's engine holds now."""
    levels: list[LevelView]
    history: list[browse.HistoryPoint]


class DeploymentView(msgspec.Struct, kw_only=True):
    object: str = "deployment"
    at: float
    models: list[ModelView]
    workers: list[WorkerStatus]


class RecordView(msgspec.Struct, kw_only=True):
    """One job's record as the console shows it."""

    object: str = "job.record"
    id: str
    model: str
    status: str
    dialect: str
    tenant: str
    priority: int | None
    queued_at: float
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    deadline: float | None
    attempts: int
    preemptions: int
    preempted_ms: int
    runs: list[Run]
    trace_id: str | None
    """With tracing on: the trace of the request that queued it (its ``traceparent``'s)."""
    prompt_tokens: int | None
    generated_tokens: int | None
    request: GenerationRequest
    result: Any
    error: JobError | None
    queue_position: int | None = None
    """While it waits: how many jobs of its model are estimated to start before it."""
    eta_s: float | None = None
    """While it waits: seconds until it is estimated to start (null while unknown)."""

    @classmethod
    def of(cls, r: JobRecord, standing: Standing | None = None) -> RecordView:
        prompt_tokens, generated_tokens = r.token_counts()
        return cls(id=r.id, model=r.model, status=r.status, dialect=r.request.dialect, tenant=r.tenant_of(),
                   priority=r.request.priority, queued_at=r.queued_at, started_at=r.started_at,
                   first_token_at=r.first_token_at, finished_at=r.finished_at, deadline=r.deadline,
                   attempts=r.attempt, preemptions=r.preemptions, preempted_ms=r.preempted_ms, runs=r.attempts(),
                   trace_id=r.traceparent.split("-")[1] if r.traceparent and r.traceparent.count("-") >= 3 else None,
                   prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, request=r.request,
                   result=r.result, error=r.error,
                   queue_position=standing.position if standing is not None else None,
                   eta_s=standing.eta_s if standing is not None else None)


class JobList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[browse.JobSummary]


class TenantList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[browse.TenantRow]


class DeadLetterList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[browse.DeadLetterView]


class DeadLetterDeleted(msgspec.Struct, kw_only=True):
    object: str = "dead_letter.deleted"
    job_id: str


class RequeueView(msgspec.Struct, kw_only=True):
    object: str = "requeue"
    job_id: str
    requeued_as: str


# Usage (GET /v1/usage)
class UsagePage(msgspec.Struct, kw_only=True):
    object: str = "list"
    tenant: str
    start_date: str
    end_date: str
    data: list[UsageRow]
    """One row per day and model with any usage, oldest day first."""


# Health probes
class Ping(msgspec.Struct, kw_only=True):
    status: Literal["Healthy", "Unhealthy"]
    model: str
    ready_workers: int


class Liveness(msgspec.Struct):
    status: str = "alive"


class Readiness(msgspec.Struct):
    status: Literal["ready", "unready"]
    redis: Literal["ok", "unreachable"]


# LoRA adapters, in vLLM's shape (the bodies POST /v1/load_lora_adapter and /unload_lora_adapter read)
_Name = Annotated[str, msgspec.Meta(max_length=256)]


class LoadAdapter(msgspec.Struct, kw_only=True):
    lora_name: _Name
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)]
    load_inplace: bool = False
    base_model_name: _Name | None = None
    """llmq's: the base model the adapter was trained on; default: LLMQ_MODEL's."""
    private: bool = False
    """llmq's: only the caller's key (and operators) may see and use it; others get a 404 for its name."""


class UnloadAdapter(msgspec.Struct, kw_only=True):
    lora_name: _Name
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed
