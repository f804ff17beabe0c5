"""Typed errors, defined once. No web framework here: ``api/errors.py`` maps them to HTTP once,
in each dialect's shape, and the worker turns them into terminal ``error`` events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.events import Error

__all__ = [
    "ServiceError",
    "InvalidRequest",
    "ModelNotFound",
    "JobNotFound",
    "QueueUnavailable",
    "GenerationFailed",
    "EngineDead",
    "JobCancelled",
    "DeadLetter",
    "WorkerLost",
    "LeaseLost",
    "Unauthorized",
    "Overloaded",
    "RateLimited",
    "PayloadTooLarge",
    "DeadlineExceeded",
    "error_from_code",
]


class ServiceError(Exception):
    """Base of every error llmq reports on purpose. ``code`` is stable; ``status`` is HTTP."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def event(self, seq: int) -> Error:
        """The terminal ``error`` event that reports this error as event ``seq`` of a job."""
        from shared.events import Error  # events imports this module: the union is built on it

        return Error(seq=seq, code=self.code, message=self.message, status=self.status)


class InvalidRequest(ServiceError):
    status = 400
    code = "invalid_request"


class ModelNotFound(ServiceError):
    status = 404
    code = "model_not_found"


class JobNotFound(ServiceError):
    status = 404
    code = "job_not_found"


class QueueUnavailable(ServiceError):
    """Redis is unreachable: a dependency failure, never the client's fault."""

    status = 503
    code = "queue_unavailable"


class GenerationFailed(ServiceError):
    status = 500
    code = "generation_failed"


class EngineDead(ServiceError):
    """The worker's engine is gone: the job fails, and the worker exits to be restarted."""

    status = 503
    code = "engine_dead"


class JobCancelled(ServiceError):
    status = 499
    code = "cancelled"


class DeadLetter(ServiceError):
    """The job's deliveries kept ending without an answer (workers died or stalled running it)."""

    status = 500
    code = "dead_letter"


class WorkerLost(ServiceError):
    """The worker died after streaming part of a job that cannot be continued seamlessly."""

    status = 503
    code = "worker_lost"


class LeaseLost(ServiceError):
    """Internal: this worker no longer owns the job (a peer reclaimed it); it writes nothing more."""

    status = 503
    code = "lease_lost"


class Unauthorized(ServiceError):
    """API keys are on and the request carried none, or an unknown one."""

    status = 401
    code = "unauthorized"


class Overloaded(ServiceError):
    """The model's queue is at its depth limit: refused now (429 + Retry-After) rather than
    queued behind work it could not be served after."""

    status = 429
    code = "overloaded"


class RateLimited(ServiceError):
    """The tenant is past one of its own limits (shared/tenants.py): refused with 429 and a
    Retry-After from the tenant's own figures."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class PayloadTooLarge(ServiceError):
    status = 413
    code = "payload_too_large"


class DeadlineExceeded(ServiceError):
    """The job's deadline passed: in the queue (it never started) or while running (aborted)."""

    status = 504
    code = "deadline_exceeded"


def error_from_code(code: str, message: str, status: int) -> ServiceError:
    """Rebuild a typed error from a terminal ``error`` event (which crossed a process boundary)."""
    for cls in _ALL:
        if cls.code == code:
            return cls(message)
    exc = ServiceError(message)
    exc.code, exc.status = code, status
    return exc


_ALL = (InvalidRequest, ModelNotFound, JobNotFound, QueueUnavailable, GenerationFailed,
        EngineDead, JobCancelled, DeadLetter, WorkerLost, Unauthorized, Overloaded, RateLimited, PayloadTooLarge,
        DeadlineExceeded)
