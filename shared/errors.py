"""Typed errors, defined once. No web framework here: ``api/errors.py`` maps them to HTTP once,
in each dialect's shape, and the worker turns them into terminal ``error`` events.

Every code llmq emits is a class, which names its HTTP status and its stable code where it is
declared (``class JobNotFound(ServiceError, status=404, code="job_not_found")``). Declaring one
registers it under its code (a second class with the same code is a mistake caught at import),
so an error that crossed a process boundary as code + message is rebuilt by
:func:`error_from_code` as the same class, and the rest of the code compares classes
(``isinstance``), never code strings.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ServiceError",
    "InternalError",
    "UnknownError",
    "HttpError",
    "InvalidRequest",
    "ModelNotFound",
    "JobNotFound",
    "JobMissing",
    "QueueUnavailable",
    "QueueRefused",
    "NotDurable",
    "GenerationFailed",
    "EngineDead",
    "EngineFault",
    "IncompleteGeneration",
    "IncompleteGenerationStream",
    "JobCancelled",
    "DeadLetter",
    "WorkerLost",
    "LeaseLost",
    "Preempted",
    "TokenizerUnavailable",
    "Forbidden",
    "Unauthorized",
    "Overloaded",
    "RateLimited",
    "SloUnattainable",
    "PayloadTooLarge",
    "DeadlineExceeded",
    "error_from_code",
]

_BY_CODE: dict[str, type[ServiceError]] = {}


class ServiceError(Exception):
    """Base of every error llmq reports on purpose. ``code`` is stable; ``status`` is HTTP.
    Raise a subclass: each declares its own code."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"

    def __init_subclass__(cls, *, status: int | None = None, code: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if code is None:
            return  # shares its parent's code (and is rebuilt as the parent)
        cls.code = code
        other = _BY_CODE.setdefault(code, cls)
        if other is not cls:
            raise TypeError(f"error code {code!r} is taken by {other.__qualname__}")

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InternalError(ServiceError, code="internal_error"):
    """Something llmq did not expect: a logged 500, never the client's fault."""


class UnknownError(ServiceError, code="unknown_error"):
    """An error event whose code this process has no class for (a newer worker wrote it): kept
    with the code and status it came with."""

    def __init__(self, message: str, *, code: str, status: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.code, self.status = code, status  # type: ignore[misc]  # this one error's own


class HttpError(ServiceError, code="http_error"):
    """The web framework's own refusal (a 405, a 404 of an unknown path): its status kept."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]  # the framework's, per instance


class InvalidRequest(ServiceError, status=400, code="invalid_request"):
    """The request cannot be served as it is: each dialect answers with its own 4xx."""


class ModelNotFound(ServiceError, status=404, code="model_not_found"):
    """The deployment does not know the model (not configured, and no worker ever served it)."""


class JobNotFound(ServiceError, status=404, code="job_not_found"):
    """No such job for this caller (another key's job is reported the same way)."""


class JobMissing(ServiceError, status=404, code="job_missing"):
    """A queued entry whose job record was gone when a worker read it (it expired, or was never
    written): the entry is cleared with this error."""


class QueueUnavailable(ServiceError, status=503, code="queue_unavailable"):
    """Redis is unreachable: a dependency failure, never the client's fault."""


class QueueRefused(ServiceError, status=503, code="queue_refused"):
    """Redis is up but takes no new job now: it is at its memory limit or LLMQ_REDIS_MEMORY_WATERMARK,
    or a failover is under way (a demoted primary, too few replicas). Nothing was queued."""


class NotDurable(ServiceError, status=503, code="not_durable"):
    """LLMQ_DURABILITY=replicas:N, and fewer than N replicas confirmed the job in time. It may still
    run: a retry with the same Idempotency-Key never runs it twice."""


class GenerationFailed(ServiceError, code="generation_failed"):
    """The engine failed while generating this job (anything but its own death): the job ends,
    the worker goes on."""


class EngineDead(ServiceError, status=503, code="engine_dead"):
    """Internal: the worker's engine died under the job. The worker writes nothing about it, rebuilds
    its engine and continues the job (workers/runner.py), or, past LLMQ_ENGINE_RESTARTS, exits and
    leaves it to a peer."""


class EngineFault(ServiceError, status=424, code="engine_fault"):
    """The job killed its engine while it ran alone in it: it is not run again (the dead-letter
    stream keeps it). 424, Failed Dependency: the request depends on an engine it breaks; retrying
    it cannot help, so no Retry-After."""


class IncompleteGeneration(ServiceError, code="incomplete_generation"):
    """A finished job with no sequence to answer with (TGI's ``IncompleteGeneration``)."""


class IncompleteGenerationStream(ServiceError, code="incomplete_generation_stream"):
    """A stream's events ended without its final one (TGI's)."""


class JobCancelled(ServiceError, status=499, code="cancelled"):
    """Cancelled by its client (a DELETE, or the client left before its answer)."""


class DeadLetter(ServiceError, code="dead_letter"):
    """The job's deliveries kept ending without an answer (workers died or stalled running it)."""


class WorkerLost(ServiceError, status=503, code="worker_lost"):
    """The worker died after streaming part of a job that cannot be continued seamlessly."""


class LeaseLost(ServiceError, status=503, code="lease_lost"):
    """Internal: this worker no longer owns the job (a peer reclaimed it); it writes nothing more."""


class Preempted(LeaseLost, code="preempted"):
    """Internal: this worker gave the job's slot to a waiting job owed it (preempt.lua); the job
    waits again and continues on whichever worker picks it. This one writes nothing more about it."""


class TokenizerUnavailable(ServiceError, status=404, code="tokenizer_unavailable"):
    """The API has no tokenizer for the model (it holds LLMQ_MODEL's only)."""


class Forbidden(ServiceError, status=403, code="forbidden"):
    """The caller's key may not do this (an operator's action), or its address may not (the
    console with no keys, from elsewhere than loopback)."""


class Unauthorized(ServiceError, status=401, code="unauthorized"):
    """API keys are on and the request carried none, or an unknown one."""


class Overloaded(ServiceError, status=429, code="overloaded"):
    """The model's queue is at its depth limit: refused now (429 + Retry-After) rather than
    queued behind work it could not be served after."""


class SloUnattainable(Overloaded, code="slo_unattainable"):
    """The request's TTFT SLO cannot be met: the work ahead of it is predicted to take longer
    (docs/guarantees.md#slos). Refused at once, as a full queue is, before it costs any engine
    time; Retry-After is how far past the SLO the prediction is."""

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class RateLimited(ServiceError, status=429, code="rate_limited"):
    """The tenant is past one of its own limits (shared/tenants.py): refused with 429 and a
    Retry-After from the tenant's own figures."""

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class PayloadTooLarge(ServiceError, status=413, code="payload_too_large"):
    """The body is over LLMQ_MAX_BODY_BYTES."""


class DeadlineExceeded(ServiceError, status=504, code="deadline_exceeded"):
    """The job's deadline passed: in the queue (it never started) or while running (aborted)."""


def error_from_code(code: str, message: str, status: int) -> ServiceError:
    """Rebuild a typed error from a terminal ``error`` event or a stored job error (which
    crossed a process boundary as code + message)."""
    cls = _BY_CODE.get(code)
    if cls is None or cls in (UnknownError, HttpError):  # their codes are not theirs alone
        return UnknownError(message, code=code, status=status)
    return cls(message)
