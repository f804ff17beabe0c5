"""What several dialects share: refusing a request in one line, the checks of a chat's tools, a
turn's text and image parts in the internal form, and OpenAI's error object (vLLM's OpenAI server
and the Responses API frame errors alike)."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from shared.errors import InvalidRequest
from shared.schemas import Image, ImageDetail, Part, Text, Tool, ToolUse, ToolUseChoice

__all__ = ["refuse", "required", "tool_use", "url_image", "content_of", "ErrorObject", "ErrorResponse"]

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


_DETAILS: dict[str | None, ImageDetail | None] = {None: None, "auto": "auto", "low": "low", "high": "high",
                                                 "original": "original"}


def _image_url(url: str) -> bool:
    scheme, colon, rest = url.partition(":")
    scheme = scheme.lower()
    return bool(colon) and (scheme == "data" or scheme in ("http", "https") and len(rest) > 2
                            and rest.startswith("//"))


def url_image(url: str, detail: str | None = None, *, url_at: str, detail_at: str = "",
              param: str | None = None) -> Image:
    """An image a dialect names by URL, its shape checked and nothing more: ``url`` a ``data:`` URL
    or an http(s) URL, ``detail`` (OpenAI's) ``auto``, ``low``, ``high`` or ``original``. Admission
    (api/media.py) decodes or fetches it later, and checks what it holds. ``url_at`` and
    ``detail_at`` name the fields in the request (the messages say where); ``param``: the error's
    ``param``, else ``url_at`` or ``detail_at`` itself."""
    refuse(not _image_url(url), f"{url_at}: an image URL must be an http(s) URL or a data: URL",
           param or url_at)
    refuse(detail not in _DETAILS, f"{detail_at}: Input should be 'auto', 'low', 'high' or 'original', got {detail!r}",
           param or detail_at)
    return Image(url=url, detail=_DETAILS[detail])


def content_of(parts: list[Part], sep: str = "\n") -> tuple[str, list[Part]]:
    """A turn's ``content`` and ``parts`` (:class:`shared.schemas.ChatMessage`) from its texts and
    images in the client's order. Without an image: its texts joined with ``sep`` (the dialect's
    join, as before images were taken) and no parts, so a text-only turn is what it always was.
    With one: no content, and its parts in order, consecutive texts joined with ``sep`` into one
    part, each image in place between them."""
    if not any(isinstance(p, Image) for p in parts):
        return sep.join(p.text for p in parts if isinstance(p, Text)), []
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if isinstance(p, Text) and isinstance(last, Text):
            out[-1] = Text(text=last.text + sep + p.text)
        else:
            out.append(p)
    return "", out


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
