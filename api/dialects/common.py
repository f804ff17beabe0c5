"""What several dialects share: refusing a request in one line, and OpenAI's error object (vLLM's
OpenAI server and the Responses API frame errors alike)."""

from __future__ import annotations

import msgspec

from shared.errors import InvalidRequest

__all__ = ["refuse", "ErrorObject", "ErrorResponse"]


def refuse(bad: bool, message: str, param: str | None = None) -> None:
    """Refuse the request with ``message`` (each dialect renders :class:`InvalidRequest` in its
    own shape) when ``bad``."""
    if bad:
        raise InvalidRequest(message, param=param)


class ErrorObject(msgspec.Struct, kw_only=True):
    """OpenAI's error object. ``code``: vLLM's servers put the HTTP status there; the Responses
    API a string code (or null)."""

    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorObject
