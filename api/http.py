"""Small HTTP helpers every route uses: typed body decoding, fire-and-poll, stream responses;
and the middleware that ties each request's jobs to its connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
import structlog
from litestar import Request, Response
from litestar.datastructures import Headers
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import KeyGuard, presented_key
from api.context import WATCHES, RequestContext
from api.fanout import enqueue_all
from api.relay import prefetch
from api.services import Services
from api.watches import JobWatch, end_watches
from shared import json_input
from shared.codec import encode
from shared.errors import InvalidRequest
from shared.events import Event
from shared.framing import Keepalive
from shared.schemas import GenerationRequest

__all__ = ["decode_body", "accepted", "Accepted", "stream_response", "event_stream", "EventStream", "json_response",
           "RequestLifecycle", "CoalescingSend"]

log = structlog.get_logger()

T = TypeVar("T")

# Streams must reach the client as they are produced: no proxy buffering, no caching.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def decode_body(request: Request, kind: type[T]) -> T:
    """Validate the body against the dialect's schema; failures become InvalidRequest, which each
    dialect renders in its own error shape. Any byte sequence is a 4xx here, never a 500
    (``shared.json_input``: invalid UTF-8, a BOM, an empty body, nesting too deep, ...)."""
    body = await request.body()
    try:
        return json_input.decode(body, json_input.decoder_for(kind))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Malformed JSON body: {exc}") from None


class Accepted(msgspec.Struct, kw_only=True):
    """The 202 of ``Prefer: respond-async`` and ``POST /v1/jobs``: where to poll."""

    id: str
    status: str = "queued"
    url: str


async def accepted(svc: Services, ctx: RequestContext, reqs: GenerationRequest | list[GenerationRequest]) -> Response:
    """``Prefer: respond-async`` (and ``POST /v1/jobs``): 202 with the id to poll at ``Location``; a
    request that queues several jobs (a list of prompts) gets one id for all of them."""
    job_id = await enqueue_all(svc, ctx, reqs if isinstance(reqs, list) else [reqs])
    location = f"/v1/jobs/{job_id}"
    return json_response(Accepted(id=job_id, url=location), 202, headers={"Location": location})


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(body), status_code=status, media_type="application/json", headers=headers)


def stream_response(content: AsyncIterator[bytes], media_type: str, headers: dict[str, str] | None = None) -> Stream:
    return Stream(content, media_type=media_type, headers={**STREAM_HEADERS, **(headers or {})})


Events = AsyncIterator[Event | Keepalive]


def event_stream(events: Events, render: Callable[[Events], AsyncIterator[bytes]], media_type: str,
                 start_within_s: float) -> EventStream:
    """A job's events streamed in a dialect's framing (``render``), the response held until the
    first event or ``start_within_s`` (:func:`api.relay.prefetch`): an error that comes first
    is still answered with its own HTTP status, in the route's dialect."""
    return EventStream(events, render, media_type, start_within_s)


class EventStream(Stream):
    """The streaming response of a job's events.

    The handler returns it at once, so Litestar builds the response while the engine computes,
    and the wait for the first event (:func:`api.relay.prefetch`) runs inside the response:
    once it arrives only the headers and the first chunk are left to send. An error that comes
    first is raised before anything is sent, to the same exception handlers as the route's own
    errors. The client leaving is heard by :class:`RequestLifecycle`, which cancels the whole
    request, so the response needs no listener task of its own (Litestar's stream runs one in a
    task group per response).
    """

    __slots__ = ("events", "render", "start_within_s")

    def __init__(self, events: Events, render: Callable[[Events], AsyncIterator[bytes]], media_type: str,
                 start_within_s: float) -> None:
        super().__init__((), media_type=media_type, headers=STREAM_HEADERS)
        self.events, self.render, self.start_within_s = events, render, start_within_s

    def to_asgi_response(self, app: Any, request: Request, *, headers: dict[str, str] | None = None,
                         media_type: MediaType | str | None = None, status_code: int | None = None,
                         **_: Any) -> ASGIResponse:
        # As Stream.to_asgi_response, with this response's own ASGI class (it sets no cookies
        # and runs no background task).
        return _HeldStart(self, headers={**headers, **self.headers} if headers is not None else self.headers,
                          media_type=self.media_type or media_type, status_code=self.status_code or status_code)


class _HeldStart(ASGIStreamingResponse):
    __slots__ = ("_stream",)

    def __init__(self, stream: EventStream, **kwargs: Any) -> None:
        super().__init__(iterator=(), **kwargs)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self._stream
        events = await prefetch(stream.events, stream.start_within_s)
        await self.start_response(send)
        chunks = stream.render(events)
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class RequestLifecycle:
    """ASGI middleware: a request's jobs live as long as its connection.

    - Every job a request (or LMTP socket) submits is watched; when the request ends before a
      job's terminal event was relayed, the job is cancelled (:func:`api.submit.end_watches`).
    - A client that disconnects while a non-streaming handler still waits is noticed here: once
      the body is read, a task listens for ``http.disconnect`` and cancels the handler (uvicorn
      and Litestar never cancel a handler by themselves; a streaming response is stopped by
      Litestar, which hears the same disconnect through this middleware's ``receive``). Only
      ``http.disconnect`` counts: an idle timeout never looks like a client that left.
    - The watch set is handed to the request's context (:func:`api.context.request_context`)
      through the ASGI scope, the one channel from a middleware to its app.
    - With API keys on, a WebSocket upgrade without a valid key is refused with HTTP 401 (or a
      policy-violation close where the server cannot send a denial response).
    """

    def __init__(self, app: ASGIApp, guard: KeyGuard | None = None) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket" and self.guard is not None:
            if not self.guard.valid(presented_key(Headers.from_scope(scope))):
                await _refuse_websocket(scope, receive, send)
                return
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        watches: set[JobWatch] = set()
        scope[WATCHES] = watches  # type: ignore[literal-required]
        try:
            if kind == "http":
                await _until_disconnect(self.app, scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            await end_watches(watches)


async def _until_disconnect(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    gone = asyncio.Event()
    body_read = response_done = False
    listener: asyncio.Task[None] | None = None

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        if not response_done:
            handler.cancel()

    async def app_receive() -> Message:
        # Until the body is read, the app reads it; after that only this middleware reads the
        # connection, and the app hears of a disconnect through ``gone``.
        nonlocal body_read, listener
        if body_read:
            await gone.wait()
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.disconnect":
            body_read = True
            gone.set()
        elif not message.get("more_body", False):
            body_read = True
            listener = asyncio.create_task(listen())
        return message

    out = CoalescingSend(send)  # a stream's chunks of one loop turn go out in one write

    async def app_send(message: Message) -> None:
        nonlocal response_done
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            response_done = True
        await out(message)

    handler: asyncio.Task[Any] = asyncio.create_task(app(scope, app_receive, app_send))
    try:
        await handler
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not gone.is_set() or (current is not None and current.cancelling()):
            raise  # the server is cancelling us, not a client that left
        log.info("client_disconnected", path=scope.get("path"))
    finally:
        if listener is not None:
            listener.cancel()


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()  # websocket.connect
    message = "Missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "websocket.http.response.body", "body": encode({"error": message})})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})


class CoalescingSend:
    """An ASGI ``send`` that merges the body chunks a streaming response produces in one event-loop
    turn into one write.

    Without it every SSE event is one ``send()`` syscall on the client's socket (and one wake-up of
    the client): half of the API's CPU in the relay benchmark. Chunks are held at most until the
    end of the current loop turn (a task flushes them), or until ``flush_bytes`` are buffered (then
    the producer awaits the write, so transport back-pressure still applies). Anything that is not
    a non-final body chunk flushes first and passes straight through, so order is kept.
    """

    __slots__ = ("_send", "_parts", "_size", "_pending", "_lock", "_error", "flush_bytes")

    def __init__(self, send: Callable[[Any], Any], flush_bytes: int = 65536) -> None:
        self._send = send
        self._parts: list[bytes] = []
        self._size = 0
        self._pending: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._error: BaseException | None = None
        self.flush_bytes = flush_bytes

    async def __call__(self, message: Any) -> None:
        if self._error is not None:
            raise self._error
        if message["type"] == "http.response.body" and message.get("more_body", False):
            body = message.get("body", b"")
            if body:
                self._parts.append(body)
                self._size += len(body)
                if self._size >= self.flush_bytes:
                    await self._flush()
                elif self._pending is None:
                    self._pending = asyncio.get_running_loop().create_task(self._flush_soon())
            return
        await self._flush()
        await self._send(message)

    async def _flush_soon(self) -> None:
        self._pending = None  # chunks added while this one writes schedule the next flush
        try:
            await self._flush()
        except Exception as exc:  # raised to the producer on its next send (it may be gone)
            self._error = exc

    async def _flush(self) -> None:
        async with self._lock:  # one write at a time: a write that waits on back-pressure keeps order
            if not self._parts:
                return
            body = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts, self._size = [], 0
            await self._send({"type": "http.response.body", "body": body, "more_body": True})
