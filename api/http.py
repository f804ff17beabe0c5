"""HTTP bodies in and out, as every route uses them: typed body decoding, JSON answers, and the
streamed answer of a job's events (:class:`EventStream`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any, TypeVar, cast

from litestar import Request, Response
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Scope, Send

from api.body import decode
from api.dialects.stream import StreamRenderer, drive, render
from api.follow import Events, Lane, prefetch
from api.middleware import OUT, CoalescingSend
from shared.codec import encode
from shared.events import Event

__all__ = ["decode_body", "json_response", "stream_response", "stream_frames", "EventStream"]

T = TypeVar("T")

# Streams must reach the client as they are produced: no proxy buffering, no caching.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def decode_body(request: Request, kind: type[T]) -> T:
    """The request's body as ``kind`` (:func:`api.body.decode`: its errors are InvalidRequest)."""
    return decode(kind, await request.body())


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(body), status_code=status, media_type="application/json", headers=headers)


def stream_response(content: AsyncIterator[bytes], media_type: str, headers: dict[str, str] | None = None) -> Stream:
    return Stream(content, media_type=media_type, headers={**STREAM_HEADERS, **(headers or {})})


def stream_frames(frames: list[bytes], media_type: str) -> Stream:
    """A stream whose frames are all known now (one error event, one whole answer)."""
    return stream_response(_each(frames), media_type)


async def _each(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


class EventStream(Stream):
    """The streamed answer of a job's events, in a dialect's framing (its renderer).

    The handler returns it at once, so Litestar builds the response while the engine computes.
    With ``start_within_s`` the wait for the first event (:func:`api.follow.prefetch`) runs inside
    the response: an error that comes first is raised before anything is sent, to the same
    exception handlers as the route's own errors (a real HTTP status, in the route's dialect);
    once the first event arrives only the headers and the first chunk are left to send. Without
    it (a replay of a job already answered) the response starts at once. Each event's frames go
    out as one chunk. The client leaving is heard by :class:`api.middleware.RequestLifecycle`,
    which cancels the whole request, so the response needs no listener task of its own
    (Litestar's stream runs one in a task group per response). The events are closed when the
    response ends, which releases the job's subscription.
    """

    __slots__ = ("events", "renderer", "start_within_s")

    def __init__(self, events: Events, renderer: StreamRenderer[bytes], start_within_s: float | None = None) -> None:
        super().__init__((), media_type=renderer.media_type, headers=STREAM_HEADERS)
        self.events, self.renderer, self.start_within_s = events, renderer, start_within_s

    def to_asgi_response(self, app: Any, request: Request, *, headers: dict[str, str] | None = None,
                         media_type: MediaType | str | None = None, status_code: int | None = None,
                         **_: Any) -> ASGIResponse:
        # As Stream.to_asgi_response, with this response's own ASGI class (it sets no cookies
        # and runs no background task).
        return _Streamed(self, headers={**headers, **self.headers} if headers is not None else self.headers,
                         media_type=self.media_type or media_type, status_code=self.status_code or status_code)


class _Streamed(ASGIStreamingResponse):
    __slots__ = ("_response",)

    def __init__(self, stream: EventStream, **kwargs: Any) -> None:
        super().__init__(iterator=(), **kwargs)
        # Not ``_stream``: that name is the base class's sending method, which __call__ replaces.
        self._response = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self._response
        events = stream.events
        try:
            if stream.start_within_s is not None:
                events = await prefetch(events, stream.start_within_s)
            await self.start_response(send)
            renderer = stream.renderer
            chunks = drive(renderer, events)
            lane: Lane | None = getattr(events, "lane", None)
            # Our own scope key (api/middleware.py), which Litestar's Scope type cannot list.
            out = cast("CoalescingSend | None", scope.get(OUT))
            if lane is not None and out is not None:
                # The events that come in sequence are rendered and written in the listener's step.
                lane.deliver = functools.partial(_deliver, renderer, out)
            try:
                async for frames in chunks:
                    body = frames[0] if len(frames) == 1 else b"".join(frames)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            finally:
                if lane is not None:
                    lane.deliver = None
                await chunks.aclose()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()


def _deliver(renderer: StreamRenderer[bytes], out: CoalescingSend, event: Event) -> bool:
    """One event taken in the listener's step (:class:`api.follow.Lane`): its frames are held for
    this turn's write; False (nothing rendered) while the client is not keeping up."""
    if not out.ready():
        return False
    frames = render(renderer, event)
    if frames:
        out.write(frames[0] if len(frames) == 1 else b"".join(frames))
    return True
