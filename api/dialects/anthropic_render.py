"""Anthropic Messages' response shapes: the message, its stream of named events, and errors.

A message's ``content`` is, in this order: one ``thinking`` block (the reasoning the worker's
reasoning parser separated), one ``text`` block (the content; left out when empty and another
block is there, as Anthropic does), then one ``tool_use`` block per call. ``stop_reason`` is
``tool_use`` whenever the message ends with tool_use blocks (Anthropic's rule; so also for a
forced ``any`` or ``tool`` choice, whose finish reason is ``stop``), except that ``max_tokens``
always wins and a matched stop string wins over a call it cut short.

Ids and signatures are derived, never random, so the same job renders byte for byte the same
(a replayed stream, a poll of the stored job): a call ``call_<x>`` is the block ``toolu_<x>``, and
a thinking block's ``signature`` is a hash of the job id and the block's index. llmq does not check
signatures sent back; it only needs them opaque and stable.

A stream is Anthropic's named SSE events, ``event: <name>\\ndata: <json>\\n\\n``: ``message_start``
(and one ``ping``) at the job's first token event, then each block in the order of the final
``content``: ``content_block_start`` / deltas / ``content_block_stop``, with ``index`` its position
there. A block opens when its first piece arrives and closes before the next one opens; a thinking
block's last delta is its ``signature_delta``. Then ``message_delta`` (stop reason, cumulative
usage) and ``message_stop``. An error after the stream started is one ``event: error`` with the
error body, which ends the stream. Quiet stretches are SSE comments, which every SSE parser drops
(the SDK included).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import msgspec

from api.dialects.stream import SseKeepalive, StreamRenderer
from shared.errors import InternalError, Overloaded, ServiceError
from shared.events import Done, Tokens, ToolCallDelta
from shared.framing import sse
from shared.schemas import Choice, GenerationRequest, JobResult, ToolCall

__all__ = [
    "TextBlock",
    "ThinkingBlock",
    "ToolUseBlock",
    "Usage",
    "Message",
    "TokenCount",
    "render_result",
    "MessageStream",
    "stream",
    "event",
    "stop_of",
    "signature",
    "tool_use_id",
    "reported_tier",
    "ErrorObject",
    "ErrorResponse",
    "error_body",
]


def reported_tier(req: GenerationRequest) -> str:
    """``usage.service_tier`` as Anthropic reports it: ``priority`` when asked for, else ``standard``."""
    return req.output.service_tier or "standard"


def signature(job_id: str, index: int) -> str:
    """The ``signature`` of the thinking block at ``index`` of job ``job_id``'s message: opaque,
    base64 like Anthropic's, and the same every time the job is rendered."""
    return base64.b64encode(hashlib.sha256(f"llmq-thinking:{job_id}:{index}".encode()).digest()).decode()


def tool_use_id(call_id: str) -> str:
    """A call's block id: ``call_<x>`` (the worker's id) is ``toolu_<x>``. Sent back as a
    ``tool_use`` id or a ``tool_result``'s ``tool_use_id``, it reaches the template unchanged."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the ``input`` object; None when they are not one (a call cut short)."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


# --- response objects ---------------------------------------------------------------------------
# Field order is the order on the wire. The usage fields llmq cannot fill honestly (prompt-cache
# accounting, geography, tool use) are null, as the SDK's Usage type allows.


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str
    """Empty in a stream's ``content_block_start``: the ``signature_delta`` brings it."""


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    """Empty in a stream's ``content_block_start``: ``input_json_delta`` pieces bring it."""


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation: None = None
    output_tokens: int
    output_tokens_details: None = None
    server_tool_use: None = None
    service_tier: str | None = None
    inference_geo: str | None = None


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


def stop_of(finish_reason: str | None, stop_reason: str | int | None, *, called: bool = False,
            complete: bool = True) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` from vLLM's finish and stop reasons, and whether the
    message ends with calls (``called``) whose arguments are all whole JSON objects (``complete``):
    the length is ``max_tokens``; calls are ``tool_use``, unless a stop string cut one short; a
    matched stop string is ``stop_sequence``; EOS (or a stop token id) is ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens", None
    if called and (complete or not isinstance(stop_reason, str)):
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call: ToolCall) -> ToolUseBlock:
    return ToolUseBlock(id=tool_use_id(call.id), name=call.name, input=_input(call.arguments) or {})


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Message:
    """The message: thinking, text, tool_use blocks. A call whose arguments are not a JSON object
    (cut short by ``max_tokens``) has ``input: {}``."""
    choice = result.choices[0] if result.choices else Choice()
    calls = choice.tool_calls or []
    content: list[ContentBlock] = []
    if choice.reasoning:
        content.append(ThinkingBlock(thinking=choice.reasoning, signature=signature(job_id, 0)))
    if choice.text or not (content or calls):  # an empty answer is one empty text block, as Anthropic's
        content.append(TextBlock(text=choice.text))
    content += [_tool_use(c) for c in calls]
    complete = all(_input(c.arguments) is not None for c in calls)
    stop_reason, stop_sequence = stop_of(choice.finish_reason, choice.stop_reason, called=bool(calls),
                                         complete=complete)
    return Message(
        id=f"msg_{job_id}",
        content=content,
        model=req.served_name,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(input_tokens=result.usage.prompt_tokens, output_tokens=result.usage.completion_tokens,
                    service_tier=reported_tier(req)),
    )


# --- stream events ------------------------------------------------------------------------------


class MessageStart(msgspec.Struct, kw_only=True):
    type: str = "message_start"
    message: Message


class ContentBlockStart(msgspec.Struct, kw_only=True):
    type: str = "content_block_start"
    index: int
    content_block: ContentBlock


class Ping(msgspec.Struct, kw_only=True):
    type: str = "ping"


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, kw_only=True):
    type: str = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True):
    type: str = "content_block_stop"
    index: int


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: str
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct, kw_only=True):
    """Cumulative counts: the SDK's accumulator overwrites its snapshot with them."""

    input_tokens: int
    output_tokens: int


class MessageDelta(msgspec.Struct, kw_only=True):
    type: str = "message_delta"
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, kw_only=True):
    type: str = "message_stop"


def event(name: str, payload: msgspec.Struct) -> bytes:
    """One named Server-Sent Event, as Anthropic frames them."""
    return sse(payload, event=name)


TEXT, THINKING, TOOL_USE = "text", "thinking", "tool_use"


class MessageStream(SseKeepalive, StreamRenderer[bytes]):
    """The message opens at the job's first token event; before it only keep-alive comments go
    out. ``message_start`` has ``input_tokens`` 0: the prompt's length is known when the job ends,
    and ``message_delta`` carries it (cumulative, so the SDK's final message has it).

    Each delta's pieces go out in the order of a message's content (reasoning, text, tool-call
    pieces), each into the block of its kind: a piece of another kind than the open block's closes
    that block and opens the next, so no delta ever lands in a block of another type (what Claude
    Code's strict stream validator checks). Parsers send reasoning before content, so a message
    has one thinking block; were reasoning to resume after text, the stream would open a second
    one where the message folds all reasoning into the first. A call's first piece (with its id)
    opens its block; its argument fragments are ``input_json_delta``s, one per piece. The worker
    sends calls in order, so a fragment for a call whose block already closed (or never opened)
    cannot happen: it is an inconsistent stream, ended with an error event rather than a wrong
    message."""

    def __init__(self, req: GenerationRequest, job_id: str, created: int = 0) -> None:
        self.req, self.job_id = req, job_id
        self.started, self.output_tokens = False, 0
        self.blocks = 0  # blocks opened so far: the next block's index is this
        self.current: tuple[str, int] | None = None  # the open block's kind and, for a call, its index
        self.arguments: dict[int, list[str]] = {}  # each call's argument pieces, by call index

    def step(self, ev: Tokens | Done) -> list[bytes]:
        new_tokens = sum(len(d.token_ids) for d in ev.deltas)
        self.output_tokens += new_tokens
        out: list[bytes] = []
        for d in ev.deltas:
            if d.reasoning:
                out += self._piece(THINKING, ThinkingDelta(thinking=d.reasoning))
            if d.text:
                out += self._piece(TEXT, TextDelta(text=d.text))
            for call in d.tool_calls:
                out += self._call(call)
        if isinstance(ev, Done):
            out += self._end(ev)
        if self.started:
            return out
        self.started = True
        opening = Message(id=f"msg_{self.job_id}", content=[], model=self.req.served_name, stop_reason=None,
                          stop_sequence=None, usage=Usage(input_tokens=0, output_tokens=new_tokens,
                                                          service_tier=reported_tier(self.req)))
        # Anthropic's own order: message_start, the first content_block_start, ping.
        first = 1 if self.blocks else 0
        return [event("message_start", MessageStart(message=opening)), *out[:first], event("ping", Ping()),
                *out[first:]]

    def _start(self, kind: str, block: ContentBlock, call: int = -1) -> list[bytes]:
        out = self._close()
        self.current = (kind, call)
        out.append(event("content_block_start", ContentBlockStart(index=self.blocks, content_block=block)))
        self.blocks += 1
        return out

    def _close(self) -> list[bytes]:
        if self.current is None:
            return []
        index, out = self.blocks - 1, []
        if self.current[0] == THINKING:  # its signature is its last delta, just before its stop
            out.append(self._delta(SignatureDelta(signature=signature(self.job_id, index))))
        self.current = None
        out.append(event("content_block_stop", ContentBlockStop(index=index)))
        return out

    def _delta(self, delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta) -> bytes:
        return event("content_block_delta", ContentBlockDelta(index=self.blocks - 1, delta=delta))

    def _piece(self, kind: str, delta: TextDelta | ThinkingDelta) -> list[bytes]:
        out = []
        if self.current != (kind, -1):
            block = ThinkingBlock(thinking="", signature="") if kind == THINKING else TextBlock(text="")
            out = self._start(kind, block)
        out.append(self._delta(delta))
        return out

    def _call(self, piece: ToolCallDelta) -> list[bytes]:
        out = []
        if piece.id is not None:
            if piece.index in self.arguments:
                raise InternalError(f"tool call {piece.index} was named twice in the job's events")
            self.arguments[piece.index] = []
            block = ToolUseBlock(id=tool_use_id(piece.id), name=piece.name or "", input={})
            out = self._start(TOOL_USE, block, piece.index)
        elif not piece.arguments:
            return []
        elif self.current != (TOOL_USE, piece.index):
            raise InternalError(f"arguments of tool call {piece.index} arrived after its block closed (or before it "
                                "opened)")
        if piece.arguments:
            self.arguments[piece.index].append(piece.arguments)
            out.append(self._delta(InputJsonDelta(partial_json=piece.arguments)))
        return out

    def _end(self, ev: Done) -> list[bytes]:
        out = self._close()
        if not self.blocks:  # nothing was said: one empty text block, as in the message
            out += self._start(TEXT, TextBlock(text="")) + self._close()
        last = ev.deltas[-1] if ev.deltas else None
        finish = next((d for d in reversed(ev.deltas) if d.finish_reason is not None), last)
        complete = all(_input("".join(parts)) is not None for parts in self.arguments.values())
        stop_reason, stop_sequence = stop_of(finish.finish_reason if finish else None,
                                             finish.stop_reason if finish else None,
                                             called=bool(self.arguments), complete=complete)
        usage = DeltaUsage(input_tokens=ev.usage.prompt_tokens, output_tokens=ev.usage.completion_tokens)
        return [*out,
                event("message_delta", MessageDelta(delta=StopDelta(stop_reason=stop_reason,
                                                                    stop_sequence=stop_sequence), usage=usage)),
                event("message_stop", MessageStop())]

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [event("error", error_body(exc)[1])]


def stream(req: GenerationRequest, job_id: str, created: int) -> MessageStream:
    return MessageStream(req, job_id, created)


# --- errors -------------------------------------------------------------------------------------


class ErrorObject(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: ErrorObject


OVERLOADED = 529  # Anthropic's status when it cannot take more work (the SDK's OverloadedError)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
          OVERLOADED: "overloaded_error"}


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    """Anthropic's statuses and error types. A full queue is 529 ``overloaded_error`` (the server
    is busy, not this client over a rate limit); other statuses keep their number, typed
    ``invalid_request_error`` (4xx) or ``api_error`` (5xx) where Anthropic has no closer type."""
    status = OVERLOADED if isinstance(exc, Overloaded) else exc.status
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, ErrorResponse(error=ErrorObject(type=kind, message=exc.message))
