"""One stream loop for every dialect: each dialect's stream is a renderer fed a job's events, and
:func:`drive` is the only loop that feeds one.

A renderer turns each event into the frames to send after it (as TGI's ``ChatState.push`` does):
``open`` before any event, ``feed`` per event (tokens, the final ``done``, or the job's ``error``),
``keepalive`` when the job was quiet (the tick may carry the waiting job's queue standing), ``fail``
when the stream itself broke (the relay lost Redis, or a renderer found the events inconsistent),
``close`` after the last event. Frames are
bytes on HTTP and payloads on LMTP's WebSocket; they go out per event, in order. A renderer keeps
whatever state its dialect needs (offsets, held tokens, numbering) and does no I/O.

An HTTP stream's events usually skip the loop's own step: the listener takes each in its step and
writes the frames :func:`render` gives for it (api.follow.Lane), the same renderer state
:func:`drive` feeds; :func:`drive` still opens and closes the stream and renders whatever the
relay hands it (the first and the terminal event, gaps filled from the log, keep-alives).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

from shared.errors import InvalidRequest, ServiceError
from shared.events import Done, Error, Event, Tokens
from shared.framing import KEEPALIVE_TICK, Keepalive, comment

__all__ = ["StreamRenderer", "drive", "render", "SSE", "JSONLINES", "NDJSON", "SseKeepalive", "unstreamed"]

F = TypeVar("F")

SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
NDJSON = "application/x-ndjson"


class StreamRenderer(Generic[F]):
    """A dialect's stream of one client request (its job, or the jobs it fanned out to)."""

    media_type: str = SSE

    def open(self) -> list[F]:
        """Frames before the first event."""
        return []

    def feed(self, event: Event) -> list[F]:
        """The frames that ``event`` releases."""
        return self.failed(event) if isinstance(event, Error) else self.step(event)

    def step(self, event: Tokens | Done) -> list[F]:
        """Tokens, or the final event (which carries the last step's tokens too)."""
        raise NotImplementedError

    def failed(self, error: Error) -> list[F]:
        """The job ended with an error: by default rendered as any failure is."""
        return self.fail(error.exception())

    def fail(self, exc: ServiceError) -> list[F]:
        """The stream broke (the relay failed mid-stream), or the job failed: the in-band error."""
        raise NotImplementedError

    def keepalive(self, tick: Keepalive = KEEPALIVE_TICK) -> list[F]:
        """What a quiet stretch sends: nothing, unless the framing has comments."""
        return []

    def close(self) -> list[F]:
        """Frames after the last event (OpenAI's ``[DONE]``), also after an error."""
        return []


class _Unstreamed(StreamRenderer[bytes]):
    """What a pooling dialect (embeddings, scores, rankings) streams: nothing. Its routes answer one
    body; the renderer exists for the protocol, sends nothing while the job waits, and refuses any
    event."""

    def step(self, event: Tokens | Done) -> list[bytes]:
        raise InvalidRequest("this answer does not stream: it is one JSON body")

    def fail(self, exc: ServiceError) -> list[bytes]:
        raise InvalidRequest("this answer does not stream: it is one JSON body")


def unstreamed(req: object, job_id: str, created: int) -> StreamRenderer[bytes]:
    """The ``stream`` of a dialect whose answers never stream."""
    return _Unstreamed()


class SseKeepalive:
    """For renderers whose framing is SSE: a quiet stretch sends a comment, which every SSE
    parser drops (and which keeps proxies from closing an idle connection). While the job waits,
    the comment says where it stands (``: queue position=N eta_s=X``, :func:`shared.framing.comment`):
    every SSE dialect the same, from here."""

    def keepalive(self, tick: Keepalive = KEEPALIVE_TICK) -> list[bytes]:
        return [comment(tick)]


def render(renderer: StreamRenderer[F], item: Event | Keepalive) -> list[F]:
    """The frames one event (or a quiet stretch) releases: what :func:`drive` sends per item, and
    what a stream whose events are taken in the listener's step (api.follow.Lane) writes for one."""
    return renderer.keepalive(item) if isinstance(item, Keepalive) else renderer.feed(item)


async def drive(renderer: StreamRenderer[F], events: AsyncIterator[Event | Keepalive]
                ) -> AsyncGenerator[list[F], None]:
    """The one stream loop: the frames of ``events`` rendered by ``renderer``, one list per event
    (never empty), ending after the terminal event. A :class:`ServiceError` while relaying (or
    rendering) ends the stream with the renderer's in-band error."""
    frames = renderer.open()
    if frames:
        yield frames
    try:
        async for event in events:
            frames = render(renderer, event)
            if frames:
                yield frames
            if isinstance(event, Done | Error):
                break
    except ServiceError as exc:  # the relay itself failed (say, Redis went away mid-stream)
        frames = renderer.fail(exc)
        if frames:
            yield frames
    frames = renderer.close()
    if frames:
        yield frames
