"""LMTP over WebSocket at ``/`` (where LMQL's ``lmql serve-model`` listens; TGI's ``POST /`` shares
the path). One socket carries many streams: each GENERATE or SCORE is one job followed by its own
task, and every frame goes out through one lock, so frames never interleave mid-message.
Closing the socket cancels the jobs still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

import structlog
from litestar import WebSocket, websocket

from api import jobs
from api.context import Ctx, RequestContext
from api.dialects import lmtp
from api.dialects.stream import drive
from api.errors import service_error
from api.jobs import Submission
from api.models import caller
from api.services import Services, Svc
from shared.errors import ServiceError
from shared.redis import REDIS_DOWN

__all__ = ["ROUTES", "lmtp_socket", "Session"]

log = structlog.get_logger()

class Session:
    """One client socket: dispatches commands, runs a task per stream, owns the send lock."""

    def __init__(self, socket: WebSocket, svc: Services, ctx: RequestContext) -> None:
        self.socket = socket
        self.svc = svc
        # The socket's headers (key, deadline, priority) apply to every stream; each stream is its
        # own job, so an Idempotency-Key on the upgrade request must not merge them into one.
        self.ctx = replace(ctx, idempotency_key=None)
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def send(self, verb: str, payload: lmtp.Payload) -> None:
        text = lmtp.frame(verb, payload)
        async with self.lock:
            await self.socket.send_text(text)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(_logged(work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def handle(self, text: str) -> None:
        try:
            frame = lmtp.parse_frame(text)
        except lmtp.FrameError as exc:
            await self.send("MSG", lmtp.error_payload(exc.stream_id, exc.message))
            return
        if frame.verb == "GENERATE":
            self.spawn(self.stream(frame, self.start_generate))
        elif frame.verb == "SCORE":
            self.spawn(self.stream(frame, self.start_score))
        elif frame.verb == "MODEL_INFO":
            self.spawn(self.model_info(frame))
        else:  # LMQL's server's wording
            await self.send("MSG", lmtp.error_payload(frame.stream_id, f"Unknown command: {frame.verb}"))

    async def start_generate(self, frame: lmtp.Frame) -> tuple[Submission, lmtp.TokenFrames]:
        cmd = lmtp.decode_generate(frame)
        sub = await jobs.submit(self.svc, self.ctx, lmtp.to_generation_request(cmd))
        return sub, lmtp.TokenFrames(cmd.stream_id, lmtp.TokenStream(cmd))

    async def start_score(self, frame: lmtp.Frame) -> tuple[Submission, lmtp.TokenFrames]:
        cmd = lmtp.decode_score(frame)
        sub = await jobs.submit(self.svc, self.ctx, lmtp.to_score_request(cmd))
        return sub, lmtp.TokenFrames(cmd.stream_id, lmtp.ScoreStream(cmd))

    async def stream(self, frame: lmtp.Frame,
                     start: Callable[[lmtp.Frame], Awaitable[tuple[Submission, lmtp.TokenFrames]]]) -> None:
        """One GENERATE/SCORE stream. Its errors are TOKEN error frames: LMQL's client only
        delivers TOKEN frames to a stream, so a MSG error would leave it waiting forever. Leaving
        before its end (the socket closed) cancels its job: the request's watch does."""
        if not isinstance(frame.stream_id, int) or isinstance(frame.stream_id, bool):
            await self.send("MSG", lmtp.error_payload(frame.stream_id, f"{frame.verb} needs an integer `stream_id`"))
            return
        try:
            sub, renderer = await start(frame)
            try:
                async for payloads in drive(renderer, sub.events):
                    for payload in payloads:
                        await self.send("TOKEN", payload)
            finally:
                await sub.events.aclose()
        except ServiceError as exc:
            await self.send("TOKEN", lmtp.error_payload(frame.stream_id, exc.message))
        except REDIS_DOWN as exc:  # an outage, or a refusal (memory, failover): as a status would say
            await self.send("TOKEN", lmtp.error_payload(frame.stream_id, service_error(exc).message))
        except Exception:
            if self.closed:  # a send to the socket that just closed: nobody to tell
                raise
            log.exception("lmtp_stream_failed", stream_id=frame.stream_id, may_quote_request=True)
            await self.send("TOKEN", lmtp.error_payload(frame.stream_id, "internal server error"))

    async def model_info(self, frame: lmtp.Frame) -> None:
        """A MSG reply. An unknown model is a MSG error, as LMQL's server answers one, and so is a
        private adapter of another key's. An adapter answers with its base model's workers and context."""
        try:
            cmd = lmtp.decode_model_info(frame)
            name = cmd.model_name() or self.svc.model
            live = await self.svc.models.live()
            # A known model answers, warm worker or not.
            model = await self.svc.models.resolve(name, caller(self.svc, self.ctx))
            context = await self.svc.models.context_length(model)
        except ServiceError as exc:
            await self.send("MSG", lmtp.error_payload(frame.stream_id, exc.message))
            return
        except REDIS_DOWN:
            await self.send("MSG", lmtp.error_payload(frame.stream_id, "the queue is unavailable; try again shortly"))
            return
        info = lmtp.model_info_payload(frame.stream_id, name, live.get(model, 0), context)
        await self.send("MSG", info)

    async def close(self) -> None:
        """Cancel every stream; each one's ``finally`` cancels its job."""
        self.closed = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _logged(work: Coroutine[Any, Any, None]) -> None:
    """A stream task never dies silently; a send to a socket that just closed is routine."""
    try:
        await work
    except Exception as exc:
        log.info("lmtp_stream_ended", error_type=type(exc).__name__, error=str(exc))


@websocket("/", opt={"dialect": lmtp.NAME})
async def lmtp_socket(socket: WebSocket, svc: Svc, ctx: Ctx) -> None:
    await socket.accept()
    session = Session(socket, svc, ctx)
    try:
        while True:
            message = await socket.receive()
            if message["type"] != "websocket.receive":  # a disconnect (accept() took the connect message)
                break
            text = message.get("text")
            if text is None:  # a binary frame: LMTP is text, but be lenient about the frame type
                try:
                    text = (message.get("bytes") or b"").decode()
                except UnicodeDecodeError as exc:
                    # Not replaced with U+FFFD: a mangled model name or prompt is worse than an error.
                    await session.send("MSG", lmtp.error_payload(
                        None, f"malformed LMTP message: a binary frame that is not UTF-8 text ({exc.reason} "
                              f"at offset {exc.start})"))
                    continue
            await session.handle(text)
    except Exception as exc:  # a send to a closed socket: the client is gone
        log.debug("lmtp_socket_closed", error_type=type(exc).__name__, error=str(exc))
    finally:
        await session.close()


ROUTES: list = [lmtp_socket]
