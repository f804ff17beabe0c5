"""llmq's own job shape (``POST /v1/jobs``): the internal GenerationRequest in, JobResult out."""

from __future__ import annotations

from typing import Any

from shared.errors import ServiceError
from shared.schemas import GenerationRequest, JobResult

__all__ = ["render_result", "error_body"]

NAME = "jobs"


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> JobResult:
    return result


def error_body(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    return exc.status, {"error": {"code": exc.code, "message": exc.message, "param": exc.param, "status": exc.status}}
