"""What several dialects share: refusing a request in one line, the checks of a chat's tools, and
OpenAI's error object (vLLM's OpenAI server and the Responses API frame errors alike)."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from shared.errors import InvalidRequest
from shared.schemas import Tool, ToolUse, ToolUseChoice

__all__ = ["refuse", "required", "tool_use", "ErrorObject", "ErrorResponse"]

T = TypeVar("T")


def refuse(bad: bool, message: str, param: str | None = None) -> None:
    """Refuse the request with ``message`` (each dialect renders :class:`InvalidRequest` in its
    own shape) when ``bad``."""
    if bad:
        raise InvalidRequest(message, param=param)


def required(value: T | None, message: str, param: str | None = None) -> T:
    """``value``, refusing the request with ``message`` when it is missing (None): :func:`refuse`
    for a field that is used once checked, so its type says it is there."""
    if value is None:
        raise InvalidRequest(message, param=param)
    return value


def tool_use(tools: list[Tool] | None, choice: ToolUseChoice | None, function: str | None = None, *,
             parallel: bool = True, param: str = "tool_choice") -> ToolUse | None:
    """A chat's tools in the internal form, checked as vLLM checks them. ``choice``: ``auto``,
    ``none``, ``required`` or ``function`` (then ``function`` names the tool); None: ``auto`` with
    tools, else none. ``tools`` None (not given) refuses any choice but ``none``; no tools (None or
    an empty list): None."""
    if tools is None:
        refuse(choice not in (None, "none"), "When using `tool_choice`, `tools` must be set.", param)
    if not tools:
        return None
    names = {t.name for t in tools}
    refuse(len(names) != len(tools), "tool names must be unique", "tools")
    if choice == "function":
        refuse(function not in names,
               "The tool specified in `tool_choice` does not match any of the specified `tools`", param)
    return ToolUse(tools=tools, choice=choice or "auto", function=function if choice == "function" else None,
                   parallel=parallel)


class ErrorObject(msgspec.Struct, kw_only=True):
    """OpenAI's error object. ``code``: vLLM's servers put the HTTP status there; the Responses
    API a string code (or null)."""

    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorObject
