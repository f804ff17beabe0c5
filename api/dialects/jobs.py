"""llmq's own job shape (``POST /v1/jobs``): the internal GenerationRequest in, JobResult out."""

from __future__ import annotations

import msgspec

from shared.errors import ServiceError
from shared.schemas import GenerationRequest, JobResult

__all__ = ["ErrorDetail", "ErrorBody", "render_result", "error_body"]

NAME = "jobs"


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> JobResult:
    return result


class ErrorDetail(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None
    status: int


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def error_body(exc: ServiceError) -> tuple[int, ErrorBody]:
    detail = ErrorDetail(code=exc.code, message=exc.message, param=exc.param, status=exc.status)
    return exc.status, ErrorBody(detail)
