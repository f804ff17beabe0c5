"""The bytes of a relayed stream, in every framing a dialect uses: Server-Sent Events (with or
without the space after ``data:``), JSON lines, SSE keep-alive comments and OpenAI's ``[DONE]``.

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


def sse(payload: object, *, event_id: int | None = None, space: bool = True) -> bytes:
    """One Server-Sent Event. ``space`` is the dialect's choice: ``data: {..}`` or ``data:{..}``."""
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    data = payload if isinstance(payload, bytes) else encode(payload)
    return head + (b"data: " if space else b"data:") + data + b"\n\n"


def jsonline(payload: object) -> bytes:
    return encode(payload) + b"\n"
