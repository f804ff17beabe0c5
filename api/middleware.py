"""The ASGI middleware every request passes: the app's guard admits it, a request's jobs live as
long as its connection (:class:`RequestLifecycle`), and a stream's chunks of one loop turn go out
in one write (:class:`CoalescingSend`), every stream's in one callback (:class:`Flusher`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from litestar._asgi.utils import wrap_in_exception_handler
from litestar.datastructures import Headers
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from api import dialects
from api.auth import Guard
from api.context import WATCHES
from api.watches import JobWatch, end_watches
from shared.codec import encode
from shared.errors import ServiceError
from shared.schemas import DialectName

__all__ = ["RequestLifecycle", "CoalescingSend", "Flusher", "OUT", "run_eagerly"]

log = structlog.get_logger()

# The scope key of a response's CoalescingSend: a stream writes the frames of events taken in the
# listener's step there (api.http.EventStream), below every layer that must see the response's end.
OUT = "llmq.out"


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
    - Before anything else, the app's guard (api/auth.py: keys, or with none a browser's rules)
      judges the request from its headers and route. A refused request is answered in the
      route's dialect; a refused WebSocket upgrade before it is accepted, with the guard's HTTP
      status (or a policy-violation close where the server cannot send a denial response).
    """

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard
        self.flusher = Flusher()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        handler = scope["route_handler"]  # routed before any middleware
        method = scope["method"] if scope["type"] == ScopeType.HTTP else None  # none: a WebSocket upgrade
        refused = self.guard.refusal(Headers.from_scope(scope), method, handler.paths)
        if refused is not None:
            if kind == "http":
                await wrap_in_exception_handler(_raising(refused))(scope, receive, send)  # the route's error shape
            else:
                await _refuse_websocket(scope, receive, send, refused, handler.opt.get("dialect", "jobs"))
            return
        watches: set[JobWatch] = set()
        scope[WATCHES] = watches  # type: ignore[literal-required]  # our own key: Litestar's Scope lists its own
        try:
            if kind == "http":
                await _until_disconnect(self.app, scope, receive, send, self.flusher)
            else:
                await self.app(scope, receive, send)
        finally:
            await end_watches(watches)


async def _until_disconnect(app: ASGIApp, scope: Scope, receive: Receive, send: Send, flusher: Flusher) -> None:
    gone = asyncio.Event()
    body_read = response_done = False
    listener: asyncio.Task[None] | None = None

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        if not response_done:
            handler.cancel()

    async def app_receive() -> ReceiveMessage:
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

    out = CoalescingSend(send, flusher)  # a stream's chunks of one loop turn go out in one write
    scope[OUT] = out  # type: ignore[literal-required]  # our own key, as WATCHES

    async def app_send(message: Message) -> None:
        nonlocal response_done
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            response_done = True
        await out(message)

    # ensure_future, as create_task takes only a coroutine and Litestar types an app's call as any
    # awaitable: for a coroutine (every app is an async function) it is create_task.
    handler: asyncio.Future[None] = asyncio.ensure_future(app(scope, app_receive, app_send))
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


def _raising(refused: ServiceError) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise refused
    return app


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send, refused: ServiceError,
                            dialect: DialectName) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in (scope.get("extensions") or {}):
        status, body = dialects.error_body(dialect, refused)
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": encode(body), "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": refused.code})


class Flusher:
    """Writes what every stream held back in one loop turn, in one callback at the turn's end.

    A write whose client keeps up returns without waiting (the server's ``send`` only waits while
    the transport is paused), so it runs right there (:func:`run_eagerly`): a turn that carries one
    event to each of N streams costs one callback, not N tasks. A write that must wait goes on in a
    task of its own, so one slow client never holds up the others. One per application."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due: list[CoalescingSend] = []

    def schedule(self, out: CoalescingSend) -> None:
        if not self._due:
            asyncio.get_running_loop().call_soon(self._run)
        self._due.append(out)

    def _run(self) -> None:
        due, self._due = self._due, []
        for out in due:
            out.flush_now()


class CoalescingSend:
    """An ASGI ``send`` that merges the body chunks a streaming response produces in one event-loop
    turn into one write.

    Without it every SSE event is one ``send()`` syscall on the client's socket (and one wake-up of
    the client): half of the API's CPU in the relay benchmark. Chunks are held at most until the
    end of the current loop turn (the :class:`Flusher` writes them), or until ``flush_bytes`` are
    buffered (then the producer awaits the write, so transport back-pressure still applies).
    :meth:`write` holds a chunk without a producer's await (api.follow.Lane), and refuses one past
    ``flush_bytes``. Anything that is not a non-final body chunk waits for the held chunks to be
    written and passes straight through, so order is kept.
    """

    __slots__ = ("_send", "_flusher", "_parts", "_size", "_due", "_writing", "_error", "flush_bytes")

    def __init__(self, send: Callable[[Any], Any], flusher: Flusher, flush_bytes: int = 65536) -> None:
        self._send = send
        self._flusher = flusher
        self._parts: list[bytes] = []
        self._size = 0
        self._due = False  # the flusher will write the held chunks at the end of this turn
        self._writing: asyncio.Task[None] | None = None  # a write waiting on back-pressure
        self._error: BaseException | None = None
        self.flush_bytes = flush_bytes

    async def __call__(self, message: Any) -> None:
        if self._error is not None:
            raise self._error
        if message["type"] == "http.response.body" and message.get("more_body", False):
            body = message.get("body", b"")
            if body:
                self._hold(body)
                if self._size >= self.flush_bytes:
                    await self._drain()
            return
        await self._drain()
        await self._send(message)

    def ready(self) -> bool:
        """Whether :meth:`write` may hold more: not once ``flush_bytes`` wait unwritten (the client
        is not keeping up) or a write failed; the producer then sends and waits."""
        return self._error is None and self._size < self.flush_bytes

    def write(self, body: bytes) -> None:
        """Hold a body chunk now, for the end of this turn (check :meth:`ready` first)."""
        self._hold(body)

    def _hold(self, body: bytes) -> None:
        self._parts.append(body)
        self._size += len(body)
        if not self._due:
            self._due = True
            self._flusher.schedule(self)

    def flush_now(self) -> None:
        """Write the held chunks (the flusher, at the end of a turn); a write under way takes them."""
        self._due = False
        if self._writing is None and self._parts and self._error is None:
            self._writing = run_eagerly(self._write_held())

    async def _write_held(self) -> None:
        try:
            while self._parts:  # chunks held while a write waited go out next, in order
                body = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
                self._parts, self._size = [], 0
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception as exc:  # raised to the producer on its next send (it may be gone)
            self._error = exc
        finally:
            self._writing = None

    async def _drain(self) -> None:
        while self._error is None and (self._writing is not None or self._parts):
            if self._writing is None:
                self._writing = run_eagerly(self._write_held())
            if self._writing is not None:
                await self._writing
        if self._error is not None:
            raise self._error


def run_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` right now, in the caller's step, until it first has to wait: None if it
    finished by then, else the task that finishes it (Python 3.12's eager task start, on 3.11)."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_resume(coro, waiting))


async def _resume(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """Go on with ``coro`` from where :func:`run_eagerly` left it: waiting on ``waiting`` (a
    future, or None for a bare yield), in this task."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False
                try:
                    await waiting
                except asyncio.CancelledError:
                    if not waiting.done():  # this task is cancelled, not what coro waits on
                        waiting = coro.throw(asyncio.CancelledError())
                        continue
                except BaseException:
                    pass  # coro sees the outcome itself when it resumes
            waiting = coro.send(None)
        except StopIteration:
            return
