"""llmq's own job shape (``POST /v1/jobs``): the internal GenerationRequest in, JobResult out, and
the job's event log as Server-Sent Events (``id:`` = the event's sequence number)."""

from __future__ import annotations

from typing import Final

import msgspec

from api.dialects.stream import SseKeepalive, StreamRenderer
from shared.errors import ServiceError
from shared.events import Event
from shared.framing import sse
from shared.schemas import GenerationRequest, JobResult

__all__ = ["NAME", "ErrorDetail", "ErrorBody", "render_result", "error_body", "EventLog", "stream"]

NAME: Final = "jobs"


def render_result(req: GenerationRequest, result: JobResult, job_id: str = "", created: int = 0) -> JobResult:
    return result


class EventLog(SseKeepalive, StreamRenderer[bytes]):
    """Each event as it is stored, its sequence number as the SSE ``id``, the terminal one too."""

    def feed(self, event: Event) -> list[bytes]:
        return [sse(event, event_id=event.seq)]

    def fail(self, exc: ServiceError) -> list[bytes]:
        # No in-band error: the job has not failed, the stream broke. An SSE client reconnects
        # with its Last-Event-ID and resumes from the log.
        raise exc


def stream(req: GenerationRequest, job_id: str, created: int) -> EventLog:
    return EventLog()


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
