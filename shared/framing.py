"""The bytes of a relayed stream, in every framing a dialect uses: Server-Sent Events (named or
not, numbered or not, with or without the space after ``data:``), JSON lines, SSE keep-alive
comments and OpenAI's ``[DONE]``.

Here, not in the API's relay, because dialect modules render streams and depend only on
``shared/``; :class:`Keepalive` is the tick the relay interleaves with a job's events when it has
been quiet, which each dialect frames its own way (a comment, or nothing). While the job waits its
tick carries the job's :class:`shared.slo.Standing`, which SSE writes as the comment
``: queue position=N eta_s=X`` (:func:`comment`) in place of ``: keep-alive``.
"""

from __future__ import annotations

import msgspec

from shared.codec import encode
from shared.slo import Standing

__all__ = ["sse", "jsonline", "comment", "SSE_DONE", "KEEPALIVE", "Keepalive", "KEEPALIVE_TICK"]

SSE_DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


class Keepalive(msgspec.Struct, frozen=True):
    """Yielded by :func:`api.follow.follow` when nothing happened for ``keepalive_s`` (SSE sends a
    comment). ``standing``: where the job stands in its model's queue, when it still waits and the
    relay read it for this tick (every few seconds at most: one script call)."""

    standing: Standing | None = None


KEEPALIVE_TICK = Keepalive()
"""The plain tick: nothing to say but that the stream is alive."""


def comment(tick: Keepalive) -> bytes:
    """The SSE comment for ``tick``: ``: queue position=N eta_s=X`` (X in seconds, one decimal)
    while the job waits and its start can be predicted, else ``: keep-alive``. Always both fields,
    so a client parses one fixed shape: a standing with no ETA (no warm worker has measured its
    speed yet) is the plain comment. Any SSE parser drops a comment line, so clients that know
    nothing of it read the stream as before."""
    standing = tick.standing
    if standing is None or standing.eta_s is None:
        return KEEPALIVE
    return f": queue position={max(0, standing.position)} eta_s={max(0.0, standing.eta_s):.1f}\n\n".encode()


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
