"""The bytes of a relayed stream, in every framing a dialect uses: Server-Sent Events (named or
not, numbered or not, with or without the space after ``data:``), JSON lines, SSE keep-alive
comments and OpenAI's ``[DONE]``.

Here, not in the API's relay, because dialect modules render streams and depend only on
``shared/``; :class:`Keepalive` is the tick the relay interleaves with a job's events when it has
been quiet, which each dialect frames its own way (a comment, or nothing).
"""

from __future__ import annotations

from shared.codec import encode

__all__ = ["sse", "jsonline", "SSE_DONE", "KEEPALIVE", "Keepalive", "KEEPALIVE_TICK"]

SSE_DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


class Keepalive:
    """Yielded by :func:`follow` when nothing happened for ``keepalive_s`` (SSE sends a comment)."""


KEEPALIVE_TICK = Keepalive()


def sse(payload: object, *, event: str | None = None, event_id: int | None = None, space: bool = True) -> bytes:
    """One Server-Sent Event: ``event: <name>`` when the dialect names its events (Anthropic's,
    OpenAI Responses'), ``id: <n>`` when it numbers them, then the data. ``space`` is the
    dialect's choice: ``data: {..}`` or ``data:{..}``."""
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    if event_id is not None:
        head += f"id: {event_id}\n".encode()
    data = payload if isinstance(payload, bytes) else encode(payload)
    return head + (b"data: " if space else b"data:") + data + b"\n\n"


def jsonline(payload: object) -> bytes:
    return encode(payload) + b"\n"
