"""OpenAI Responses' stream: a job's events as numbered SSE events (the objects they carry are
:mod:`api.dialects.openai_responses_render`'s).

**Streams** are SSE with ``event: <type>`` lines and ``sequence_number`` on every event, and no
``[DONE]`` (OpenAI's server closes a Responses stream after the terminal event; the openai SDK
stops on the close). ``response.created`` and ``.in_progress`` (0, 1) open it; an output item is
announced (``output_item.added``, and for a message or reasoning its ``content_part.added``) when
its first piece arrives, gets one delta event per piece, and is finished (``…done``,
``content_part.done``, ``output_item.done`` with the whole item) when the next item starts or the
job ends; ``response.completed`` / ``.incomplete`` (the whole response, as a later read renders
it) ends the stream. The numbers count the events rendered so far, so they are a pure function
of the job's event log: a stream resumed with ``starting_after=N`` re-renders the log from its
start and sends the events numbered above N, on any web process, while the job runs or after.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec

from api.dialects.openai_responses_render import (
    MESSAGE_PREFIX,
    REASONING_PREFIX,
    Echo,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    Status,
    echo_of_request,
    finished_status,
    function_call_item,
    namespaced_names,
    render_finished,
    render_response,
)
from api.dialects.stream import SseKeepalive, StreamRenderer
from shared.errors import JobCancelled, ServiceError
from shared.events import Done, Error, Tokens, ToolCallDelta
from shared.framing import sse
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest

__all__ = ["ResponseStream", "stream"]


# --- streaming --------------------------------------------------------------------------------


class StreamResponse(msgspec.Struct, kw_only=True):
    """``response.created`` / ``.in_progress`` / ``.completed`` / ``.incomplete`` / ``.failed``."""

    type: str
    sequence_number: int
    response: Response


class ItemEvent(msgspec.Struct, kw_only=True):
    """``response.output_item.added`` / ``.done``."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class _OfItem(msgspec.Struct, kw_only=True):
    """What every event inside one output item starts with: which item it belongs to. A subclass
    adds its own fields after these (msgspec keeps a base's fields first, in order; a subclass
    that gives ``type`` a default keeps it in its place), so the wire order is OpenAI's."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int


class _OfPart(_OfItem, kw_only=True):
    """An event of an item's content part (a message's text, a reasoning item's text)."""

    content_index: int = 0


class PartEvent(_OfPart, kw_only=True):
    """``response.content_part.added`` / ``.done``, of a message (``output_text``) or of a
    reasoning item (``reasoning_text``, as vLLM streams it)."""

    part: OutputText | ReasoningText


class TextDelta(_OfPart, kw_only=True):
    type: str = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = []


class TextDone(_OfPart, kw_only=True):
    type: str = "response.output_text.done"
    text: str
    logprobs: list[Any] = []


class ReasoningDelta(_OfPart, kw_only=True):
    type: str = "response.reasoning_text.delta"
    delta: str


class ReasoningDone(_OfPart, kw_only=True):
    type: str = "response.reasoning_text.done"
    text: str


class ArgumentsDelta(_OfItem, kw_only=True):
    type: str = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDone(_OfItem, kw_only=True):
    type: str = "response.function_call_arguments.done"
    arguments: str


class ErrorEvent(msgspec.Struct, kw_only=True):
    """OpenAI's in-band ``error`` event: the stream itself broke (not the job)."""

    type: str = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None = None


StreamEvent = (StreamResponse | ItemEvent | PartEvent | TextDelta | TextDone | ReasoningDelta | ReasoningDone
               | ArgumentsDelta | ArgumentsDone | ErrorEvent)
"""Any event of a stream: each has its ``type`` and ``sequence_number``."""


def frame(event: StreamEvent) -> bytes:
    """One event as OpenAI frames it: its type as the SSE ``event:`` name, then the JSON."""
    return sse(event, event=event.type)


Key = str | int
"""An output item of a stream: ``"reasoning"``, ``"message"``, or a call's index."""


class _Where(TypedDict):
    """Where an item's events point: every event of one item repeats these."""

    item_id: str
    output_index: int


class _Open:
    """The item a stream is filling: where it is, and what it has had so far."""

    def __init__(self, key: Key, index: int, item_id: str, call: ToolCallDelta | None = None) -> None:
        self.key, self.index, self.item_id, self.call = key, index, item_id, call
        self.parts: list[str] = []

    def where(self) -> _Where:
        return _Where(item_id=self.item_id, output_index=self.index)


class ResponseStream(SseKeepalive, StreamRenderer[bytes]):
    """The job's events as OpenAI's stream; only events numbered above ``starting_after`` are sent
    (all of them are rendered: numbers count them, and the closing ones carry whole items). The
    events must start at the job's first event.

    A delta's pieces go in OpenAI's order, reasoning, then content, then calls, each to its item.
    A piece of an item already finished (no vLLM parser sends one: reasoning comes before the
    content, the content before the calls, and each call's arguments before the next call) is
    not streamed again; the final response, which is the job's result, has it."""

    def __init__(self, echo: Echo, job_id: str, created: int, *, starting_after: int = -1) -> None:
        self.echo, self.job_id, self.created, self.after = echo, job_id, created, starting_after
        self.names = namespaced_names(echo.tools)
        self.result = ResultBuilder()
        self.seq = 0  # the next event's number
        self.item: _Open | None = None
        self.done: set[Key] = set()
        self.items = 0  # output items announced
        self.finish_reason: str | None = None

    def _number(self) -> int:
        self.seq += 1
        return self.seq - 1

    def _frames(self, events: list[StreamEvent]) -> list[bytes]:
        return [frame(e) for e in events if e.sequence_number > self.after]

    def open(self) -> list[bytes]:
        start: Status = "queued" if self.echo.background else "in_progress"
        return self._frames([
            StreamResponse(type="response.created", sequence_number=self._number(),
                           response=render_response(self.echo, self.job_id, self.created, start)),
            StreamResponse(type="response.in_progress", sequence_number=self._number(),
                           response=render_response(self.echo, self.job_id, self.created, "in_progress")),
        ])

    # An item's three moments: announced, added to, finished.

    def _start(self, key: Key, call: ToolCallDelta | None = None) -> list[StreamEvent]:
        events = self._finish("completed")
        index, self.items = self.items, self.items + 1
        if key == "reasoning":
            self.item = _Open(key, index, REASONING_PREFIX + self.job_id)
            added: OutputItem = ReasoningItem(id=self.item.item_id, content=[], status="in_progress")
            part: OutputText | ReasoningText | None = ReasoningText(text="")
        elif key == "message":
            self.item = _Open(key, index, MESSAGE_PREFIX + self.job_id)
            added, part = OutputMessage(id=self.item.item_id, status="in_progress", content=[]), OutputText(text="")
        else:
            assert call is not None
            call = ToolCallDelta(index=call.index, id=call.id or f"call_{self.job_id}_{call.index}", name=call.name)
            added = function_call_item(call, "", "in_progress", self.names)
            self.item, part = _Open(key, index, added.id, call), None
        events.append(ItemEvent(type="response.output_item.added", sequence_number=self._number(),
                                output_index=index, item=added))
        if part is not None:
            events.append(PartEvent(type="response.content_part.added", sequence_number=self._number(),
                                    item_id=self.item.item_id, output_index=index, part=part))
        return events

    def _add(self, key: Key, piece: str, call: ToolCallDelta | None = None) -> list[StreamEvent]:
        if key in self.done:
            return []
        events = self._start(key, call) if self.item is None or self.item.key != key else []
        item = self.item
        assert item is not None
        if not piece:
            return events
        item.parts.append(piece)
        seq, where = self._number(), item.where()
        if key == "reasoning":
            events.append(ReasoningDelta(delta=piece, sequence_number=seq, **where))
        elif key == "message":
            events.append(TextDelta(delta=piece, sequence_number=seq, **where))
        else:
            events.append(ArgumentsDelta(delta=piece, sequence_number=seq, **where))
        return events

    def _finish(self, status: str) -> list[StreamEvent]:
        item, self.item = self.item, None
        if item is None:
            return []
        self.done.add(item.key)
        text, where = "".join(item.parts), item.where()
        events: list[StreamEvent]
        if item.key == "reasoning":
            part: OutputText | ReasoningText = ReasoningText(text=text)
            whole: OutputItem = ReasoningItem(id=item.item_id, content=[ReasoningText(text=text)], status=status)
            events = [ReasoningDone(sequence_number=self._number(), text=text, **where)]
        elif item.key == "message":
            part = OutputText(text=text)
            whole = OutputMessage(id=item.item_id, status=status, content=[OutputText(text=text)])
            events = [TextDone(sequence_number=self._number(), text=text, **where)]
        else:
            assert item.call is not None
            whole = function_call_item(item.call, text, status, self.names)
            events = [ArgumentsDone(sequence_number=self._number(), arguments=text, **where)]
        if item.key in ("reasoning", "message"):
            events.append(PartEvent(type="response.content_part.done", sequence_number=self._number(), part=part,
                                    **where))
        events.append(ItemEvent(type="response.output_item.done", sequence_number=self._number(),
                                output_index=item.index, item=whole))
        return events

    def step(self, ev: Tokens | Done) -> list[bytes]:
        self.result.add(ev)
        events: list[StreamEvent] = []
        for d in ev.deltas:
            if d.reasoning:
                events += self._add("reasoning", d.reasoning)
            if d.text:
                events += self._add("message", d.text)
            for call in d.tool_calls:
                events += self._add(call.index, call.arguments, call)
            self.finish_reason = d.finish_reason or self.finish_reason
        if isinstance(ev, Done):
            events += self._closing()
        return self._frames(events)

    def _closing(self) -> list[StreamEvent]:
        status = finished_status(self.finish_reason)
        # Nothing came: the response is one empty message, as it reads back.
        events = self._start("message") if self.items == 0 else []
        events += self._finish("incomplete" if status == "incomplete" else "completed")
        final = render_finished(self.echo, self.result.result(), self.job_id, self.created)
        events.append(StreamResponse(type=f"response.{final.status}", sequence_number=self._number(), response=final))
        return events

    def failed(self, error: Error) -> list[bytes]:
        """A job that ended with an error: ``response.failed``; a cancelled job's object says
        ``cancelled`` (OpenAI's stream has no event of its own for it)."""
        exc = error.exception()
        cancelled = isinstance(exc, JobCancelled)
        response = render_response(self.echo, self.job_id, self.created, "cancelled" if cancelled else "failed",
                                   error=None if cancelled else exc)
        return self._frames([StreamResponse(type="response.failed", sequence_number=self._number(),
                                            response=response)])

    def fail(self, exc: ServiceError) -> list[bytes]:
        """The relay failed (Redis went away mid-stream): the stream broke, not the job."""
        return [frame(ErrorEvent(sequence_number=self._number(), code=exc.code, message=exc.message))]


def stream(req: GenerationRequest, job_id: str, created: int) -> ResponseStream:
    return ResponseStream(echo_of_request(req), job_id, created)
