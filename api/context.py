"""What one request carries through the API, built once and passed explicitly.

- :class:`RequestContext`: who sent the request (the API key's owner hash), the dialect its errors
  are rendered in, the per-request option headers (deadline, priority, SLOs), its Idempotency-Key and
  ``Prefer: respond-async``, and the set of jobs it watches (cancelled when the request ends early;
  the set belongs to :class:`api.middleware.RequestLifecycle`, which ends them). Handlers that queue work
  take ``ctx: Ctx`` and hand it to :func:`api.submit.submit`.
- :class:`JobRef`: a job (or group) id from a URL, resolved to the model that holds it and checked
  against the caller's key, once, by the ``job: Job`` dependency. A job queued under another key is
  reported exactly like a missing one, so ids cannot be probed; an operator's key finds any job.

No ContextVar carries any of this: structlog's log context is the only one in the API (the
dependency binds ``dialect``, :func:`api.submit.submit` binds ``job_id`` and ``model``).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, replace
from typing import Protocol, cast

import msgspec
import structlog
from litestar.datastructures import Headers
from litestar.di import NamedDependency
from litestar.params import FromPath, SkipValidation
from litestar.types import Scope

from api.auth import owner_of, presented_key
from api.services import Services, Svc
from api.watches import JobWatch
from shared.errors import InvalidRequest, JobNotFound
from shared.events import Event
from shared.keys import TAG_CHARS, model_tag
from shared.schemas import GROUP_PREFIX, FaultMarker, JobGroup, JobRecord, Slo
from shared.tenants import DEFAULT_TENANT, SLO_MAX_MS, valid_tenant

__all__ = ["RequestContext", "Ctx", "JobRef", "Job", "request_context", "job_ref", "TIMEOUT_HEADER",
           "PRIORITY_HEADER", "SLO_TTFT_HEADER", "SLO_TPOT_HEADER", "AFFINITY_HEADER", "FAULT_HEADER",
           "WATCHES", "SPAN", "RequestTrace", "owner_of_request"]

# Per-request options every dialect accepts as headers (most wire formats have no field for them).
TIMEOUT_HEADER = "x-llmq-timeout"
"""Seconds from enqueue until the request must have finished (its deadline)."""
PRIORITY_HEADER = "x-llmq-priority"
"""An integer, lower runs earlier; a body field (OpenAI's ``priority``) wins over it."""
SLO_TTFT_HEADER = "x-slo-ttft-ms"
"""Milliseconds from enqueue to the first token (:attr:`shared.schemas.Slo.ttft_ms`): llm-d's
header name, so a client written for its gateway sends the same. A body ``slo`` wins field by field."""
SLO_TPOT_HEADER = "x-slo-tpot-ms"
"""Milliseconds per output token after the first (:attr:`shared.schemas.Slo.tpot_ms`), llm-d's too."""
AFFINITY_HEADER = "x-llmq-affinity"
"""What the client's requests share (a conversation, an agent's session): their jobs' prefix key
(shared/affinity.py); a body field (OpenAI's ``prompt_cache_key``) wins over it."""
FAULT_HEADER = "x-llmq-test-fault"
"""llmq's own fault tests: a job its worker treats as an engine killer (``kill-engine``). Refused
(400) unless LLMQ_TEST_FAULTS is on, so no production request can carry it."""
WATCHES = "llmq.watches"
"""The ASGI scope entry where :class:`api.middleware.RequestLifecycle` hands this request's watch set
to :func:`request_context` (the one place that reads it)."""
SPAN = "llmq.span"
"""The ASGI scope entry where :class:`api.tracing.Traced` hands over the request's span (tracing on)."""


class RequestTrace(Protocol):
    """What a request's context needs of its span (``api.tracing.RequestSpan``, tracing on): a
    Protocol, because the context is built in every process and OpenTelemetry is loaded only in
    a traced one."""

    traceparent: str

    def queued(self, job_id: str, model: str, tenant: str, dialect: str) -> None: ...

    def ended(self, event: Event) -> None: ...


@dataclass(frozen=True, slots=True)
class RequestContext:
    dialect: str
    """Which dialect's error shape the route answers in (its ``opt["dialect"]``)."""
    owner: str = ""
    """The API key's hash ("" with keys off): stored on every job it queues."""
    tenant: str = DEFAULT_TENANT
    """Whose fair share, quotas and usage its jobs count toward (shared/tenants.py): the
    ``LLMQ_TENANT_HEADER`` header's value when that is set, else ``owner``, else ``default``."""
    timeout_s: float | None = None
    """``X-LLMQ-Timeout``: the deadline when the body sets none."""
    priority: int | None = None
    """``X-LLMQ-Priority``: the priority when the body sets none."""
    slo: Slo | None = None
    """``x-slo-ttft-ms`` / ``x-slo-tpot-ms``: the SLOs for what the body's ``slo`` leaves unset
    (:func:`api.submit.admit` fills the rest from the tenant's defaults)."""
    affinity: str | None = None
    """``X-LLMQ-Affinity``: the prefix key when the body gives none."""
    test_fault: FaultMarker | None = None
    """``X-LLMQ-Test-Fault`` (LLMQ_TEST_FAULTS on): the fault its job's worker must cause."""
    bad_option: InvalidRequest | None = None
    """A malformed option header: raised when the request is admitted, where each dialect reports
    its body's errors (TGI's stream in-band), not on routes that queue nothing."""
    idempotency_key: str | None = None
    respond_async: bool = False
    """RFC 7240 ``Prefer: respond-async``: answer 202 with a job id instead of waiting."""
    watches: set[JobWatch] | None = None
    """The jobs this request (or LMTP socket) submitted and follows; None: nobody watches."""
    span: RequestTrace | None = None
    """The request's span, with tracing on: its jobs' records carry its ``traceparent``."""

    def as_dialect(self, dialect: str) -> RequestContext:
        """The same request answered in another dialect (LMI's ``/invocations`` with an OpenAI body)."""
        return replace(self, dialect=dialect)


def _dialect(scope: Scope) -> str:
    handler = scope.get("route_handler")
    return handler.opt.get("dialect", "jobs") if handler is not None else "jobs"


def owner_of_request(svc: Services, headers: Headers) -> str:
    """The caller's owner hash; the guard has already refused a missing or wrong key."""
    if not svc.keys_on:
        return ""
    key = presented_key(headers)
    return owner_of(key) if key else ""


def _tenant(svc: Services, headers: Headers, owner: str) -> tuple[str, InvalidRequest | None]:
    header = svc.settings.tenant_header
    if header and (named := headers.get(header)) is not None:
        if not valid_tenant(named):
            return owner or DEFAULT_TENANT, InvalidRequest(
                f"{header} must be 1-64 characters of A-Z, a-z, 0-9, '.', '_', '@' or '-'", param=header)
        return named, None
    return owner or DEFAULT_TENANT, None


def _parse_options(headers: Headers) -> tuple[float | None, int | None, InvalidRequest | None]:
    timeout = priority = None
    if (raw := headers.get(TIMEOUT_HEADER)) is not None:
        try:
            timeout = float(raw)
        except ValueError:
            return None, None, InvalidRequest("X-LLMQ-Timeout must be a number of seconds", param="X-LLMQ-Timeout")
    if (raw := headers.get(PRIORITY_HEADER)) is not None:
        try:
            priority = int(raw)
        except ValueError:
            return None, None, InvalidRequest("X-LLMQ-Priority must be an integer", param="X-LLMQ-Priority")
    return timeout, priority, None


_MS = re.compile(r"\s*[0-9]{1,18}\s*")  # whole milliseconds: no sign, no fraction, no exponent


def _slo(headers: Headers) -> tuple[Slo | None, InvalidRequest | None]:
    """The SLO headers, each checked against :class:`~shared.schemas.Slo`'s own bounds (one place
    says what an SLO may be); None when neither is sent."""
    given: dict[str, int] = {}
    for header, field in ((SLO_TTFT_HEADER, "ttft_ms"), (SLO_TPOT_HEADER, "tpot_ms")):
        if (raw := headers.get(header)) is None:
            continue
        try:
            if not _MS.fullmatch(raw):
                raise ValueError(raw)
            msgspec.convert({field: int(raw)}, Slo)  # its bounds
            given[field] = int(raw)
        except (ValueError, msgspec.ValidationError):
            return None, InvalidRequest(f"{header} must be a whole number of milliseconds, 1 to {SLO_MAX_MS}",
                                        param=header)
    return (msgspec.convert(given, Slo), None) if given else (None, None)


def _test_fault(svc: Services, headers: Headers) -> tuple[FaultMarker | None, InvalidRequest | None]:
    if (raw := headers.get(FAULT_HEADER)) is None:
        return None, None
    if not svc.settings.test_faults:
        return None, InvalidRequest("X-LLMQ-Test-Fault is for llmq's own fault tests (LLMQ_TEST_FAULTS is off)",
                                    param="X-LLMQ-Test-Fault")
    if raw != "kill-engine":
        return None, InvalidRequest("X-LLMQ-Test-Fault must be kill-engine", param="X-LLMQ-Test-Fault")
    return "kill-engine", None


def request_context(scope: Scope, svc: Svc) -> RequestContext:
    """The ``ctx`` dependency: read the request's headers once."""
    headers = Headers.from_scope(scope)
    dialect = _dialect(scope)
    structlog.contextvars.bind_contextvars(dialect=dialect)
    timeout_s, priority, bad_option = _parse_options(headers)
    slo, bad_slo = _slo(headers)
    owner = owner_of_request(svc, headers)
    tenant, bad_tenant = _tenant(svc, headers, owner)
    test_fault, bad_fault = _test_fault(svc, headers)
    prefer = headers.get("prefer", "")
    return RequestContext(
        dialect=dialect,
        owner=owner,
        tenant=tenant,
        timeout_s=timeout_s,
        priority=priority,
        slo=slo,
        affinity=headers.get(AFFINITY_HEADER) or None,
        test_fault=test_fault,
        bad_option=bad_option or bad_slo or bad_tenant or bad_fault,
        idempotency_key=headers.get("idempotency-key") or None,
        respond_async=any(token.strip().lower() == "respond-async" for token in prefer.split(",")),
        # Our own scope keys, which Litestar's Scope type cannot list: their types are the writers'.
        watches=cast("set[JobWatch] | None", scope.get(WATCHES)),
        span=cast("RequestTrace | None", scope.get(SPAN)),
    )


# How handlers ask for it: ``ctx: Ctx`` (injected by name).
Ctx = NamedDependency[RequestContext]


@dataclass(frozen=True, slots=True)
class JobRef:
    """A job or group, found: the model whose keys hold it, its id, and what was read."""

    model: str
    id: str
    found: JobRecord | JobGroup


async def job_ref(job_id: FromPath[str], scope: Scope, svc: Svc) -> JobRef:
    """The ``job`` dependency: find ``job_id``'s model by the tag its id begins with, read the
    record (or group) once, and check it belongs to the caller's key."""
    owner = owner_of_request(svc, Headers.from_scope(scope))
    is_group = job_id.startswith(GROUP_PREFIX)
    tag = job_id.removeprefix(GROUP_PREFIX)[:TAG_CHARS]
    known = await svc.models.known()
    tagged = [m for m in known if model_tag(m) == tag]
    # Ids queued before ids carried their model's tag are found by trying the other models too;
    # a tagged id is found on the first read.
    for model in (*tagged, *(m for m in known if m not in tagged)):
        found: JobRecord | JobGroup | None
        found = await (svc.queue.get_group(model, job_id) if is_group else svc.queue.get_job(model, job_id))
        if found is None:
            continue
        if owner not in svc.operators and not hmac.compare_digest(found.owner.encode(), owner.encode()):
            break  # another key's job: the same 404 as a missing one (an operator sees every job)
        structlog.contextvars.bind_contextvars(job_id=job_id, model=model)
        return JobRef(model=model, id=job_id, found=found)
    raise JobNotFound(f"job {job_id} not found")


# How handlers ask for the job of a ``{job_id}`` path: ``job: Job``.
Job = NamedDependency[SkipValidation[JobRef]]  # a dataclass read from Redis: nothing to validate
