"""The ASGI middleware every request passes: a request's jobs live as long as its connection
(:class:`RequestLifecycle`), and a stream's chunks of one loop turn go out in one write
(:class:`CoalescingSend`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from litestar.datastructures import Headers
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import KeyGuard, presented_key
from api.context import WATCHES
from api.watches import JobWatch, end_watches
from shared.codec import encode

__all__ = ["RequestLifecycle", "CoalescingSend"]

log = structlog.get_logger()


class RequestLifecycle:
    """ASGI middleware: a request's jobs live as long as its connection.

    - Every job a request (or LMTP socket) submits is watched; when the request ends before a
      job's terminal event was relayed, the job is cancelled (:func:`api.watches.end_watches`).
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
