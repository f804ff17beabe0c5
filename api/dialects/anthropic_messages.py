"""Anthropic Messages: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as the anthropic
SDK (2.x) parses them.

A request is a chat: ``system`` becomes the first message, text blocks are joined with newlines
(as vLLM's own Anthropic endpoint does for text-only models), and a conversation that ends with
an ``assistant`` turn is continued from that text (Anthropic's prefill). The worker renders it
with the model's chat template, as for OpenAI chat. Anything llmq cannot honour (images,
documents, tools, thinking, ``effort``) is refused with Anthropic's ``invalid_request_error``,
never ignored.

A stream is Anthropic's named SSE events, ``event: <name>\\ndata: <json>\\n\\n``: ``message_start``,
``content_block_start``, ``ping``, one ``content_block_delta`` (``text_delta``) per token event,
``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``. An error after
the stream started is one ``event: error`` with the error body, which ends the stream. Quiet
stretches are SSE comments, which every SSE parser drops (the SDK included).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from api.dialects.common import refuse
from api.dialects.stream import SseKeepalive, StreamRenderer
from api.dialects.tiers import priority_of_tier
from shared.errors import Overloaded, ServiceError
from shared.events import Done, Tokens
from shared.framing import sse
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    Choice,
    GenerationRequest,
    JobResult,
    OutputOptions,
    SamplingParams,
    StructuredOutput,
)

__all__ = [
    "MessagesRequest",
    "CountTokensRequest",
    "to_generation_request",
    "chat_of",
    "render_result",
    "MessageStream",
    "stream",
    "error_body",
    "event",
    "Message",
    "TokenCount",
    "ErrorResponse",
]

NAME = "anthropic_messages"
ROLES = ("user", "assistant")

# --- request ------------------------------------------------------------------------------------


class ContentBlock(msgspec.Struct, kw_only=True):
    """An input block; only ``text`` is served. Its other fields (``cache_control``, ...) are
    accepted and have no effect: llmq has no prompt cache to steer."""

    type: str
    text: str | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentBlock]


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None  # accepted and dropped: llmq neither logs nor stores it


class OutputFormat(msgspec.Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """The body of ``count_tokens``, which is also a create's body without ``max_tokens``. Unknown
    fields are accepted and ignored (newer SDKs send fields older servers do not know)."""

    model: str
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    # The 2.x SDK has no arguments for these three; clients send them through ``extra_body``.
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    service_tier: str | None = None
    output_config: OutputConfig | None = None
    # Refused when used (_refusals), never silently ignored:
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]


def _refusals(b: CountTokensRequest) -> None:
    refuse(bool(b.tools), "tools: tool use is not supported by this server", "tools")
    no_tools = b.tool_choice is None or (isinstance(b.tool_choice, dict) and b.tool_choice.get("type") == "none")
    refuse(not no_tools, "tool_choice: tool use is not supported by this server", "tool_choice")
    thinking = b.thinking is not None and b.thinking.type != "disabled"
    refuse(thinking, "thinking: extended thinking is not supported by this server", "thinking")
    effort = b.output_config is not None and b.output_config.effort is not None
    refuse(effort, "output_config.effort: effort levels are not supported by this server", "output_config")


def _text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        refuse(block.type != "text", f"{where}.{i}: content blocks of type `{block.type}` are not supported "
                "by this server (text only)", where.split(".")[0])
        refuse(block.text is None, f"{where}.{i}.text: Field required", where.split(".")[0])
        texts.append(block.text)
    return "\n".join(texts)


def chat_of(b: CountTokensRequest) -> tuple[list[ChatMessage], ChatOptions]:
    """The conversation as the worker renders it: what ``count_tokens`` counts, exactly. Consecutive
    turns of one role are one turn (as Anthropic combines them); a last ``assistant`` turn is
    continued rather than answered."""
    _refusals(b)
    refuse(not b.messages, "messages: at least one message is required", "messages")
    out: list[ChatMessage] = []
    if b.system is not None and (system := _text(b.system, "system")):
        out.append(ChatMessage(role="system", content=system))
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(b.messages):
        refuse(m.role not in ROLES, f"messages.{i}.role: Input should be 'user' or 'assistant'", "messages")
        text = _text(m.content, f"messages.{i}.content")
        if turns and turns[-1][0] == m.role:
            turns[-1] = (m.role, turns[-1][1] + "\n" + text)
        else:
            turns.append((m.role, text))
    out.extend(ChatMessage(role=role, content=text) for role, text in turns)
    prefill = turns[-1][0] == "assistant"
    return out, ChatOptions(add_generation_prompt=not prefill, continue_final_message=prefill)


def _structured(b: CountTokensRequest) -> StructuredOutput | None:
    fmt = b.output_config.format if b.output_config is not None else None
    if fmt is None:
        return None
    refuse(fmt.type != "json_schema", f"output_config.format.type: Input should be 'json_schema', got {fmt.type!r}",
            "output_config")
    refuse(fmt.schema is None, "output_config.format.schema: Field required", "output_config")
    return StructuredOutput(json=fmt.schema)


def _priority(tier: str | None) -> int | None:
    # Anthropic's own values are auto and standard_only (neither asks for more than the default);
    # OpenAI's flex and priority are accepted too, as llmq maps them for every dialect.
    return None if tier == "standard_only" else priority_of_tier(tier)


def to_generation_request(body: MessagesRequest) -> GenerationRequest:
    messages, chat = chat_of(body)
    stop = list(body.stop_sequences or [])
    refuse(any(not s for s in stop), "stop_sequences: each stop sequence must be a non-empty string",
            "stop_sequences")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=body.max_tokens,
        stop=stop,
        structured=_structured(body),
    )
    # Kept with the job (not just this response): a poll of the stored job reports the same tier.
    output = OutputOptions(service_tier="priority" if body.service_tier == "priority" else None)
    return GenerationRequest(model=body.model, messages=messages, chat=chat, sampling=sampling, output=output,
                             dialect=NAME, priority=_priority(body.service_tier))


def reported_tier(req: GenerationRequest) -> str:
    """``usage.service_tier`` as Anthropic reports it: ``priority`` when asked for, else ``standard``."""
    return req.output.service_tier or "standard"


# --- response objects ---------------------------------------------------------------------------
# Field order is the order on the wire. The usage fields llmq cannot fill honestly (prompt-cache
# accounting, geography, tool use) are null, as the SDK's Usage type allows.


class TextBlock(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str


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
    content: list[TextBlock]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


def stop_of(finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` from vLLM's finish and stop reasons: a matched stop string
    is ``stop_sequence``; EOS (or a stop token id) is ``end_turn``; the length is ``max_tokens``."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Message:
    choice = result.choices[0] if result.choices else Choice()
    stop_reason, stop_sequence = stop_of(choice.finish_reason, choice.stop_reason)
    return Message(
        id=f"msg_{job_id}",
        content=[TextBlock(text=choice.text)],
        model=req.model,
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
    index: int = 0
    content_block: TextBlock


class Ping(msgspec.Struct, kw_only=True):
    type: str = "ping"


class TextDelta(msgspec.Struct, kw_only=True):
    type: str = "text_delta"
    text: str


class ContentBlockDelta(msgspec.Struct, kw_only=True):
    type: str = "content_block_delta"
    index: int = 0
    delta: TextDelta


class ContentBlockStop(msgspec.Struct, kw_only=True):
    type: str = "content_block_stop"
    index: int = 0


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


class MessageStream(SseKeepalive, StreamRenderer[bytes]):
    """The message opens at the job's first token event; before it only keep-alive comments go
    out. ``message_start`` has ``input_tokens`` 0: the prompt's length is known when the job ends,
    and ``message_delta`` carries it (cumulative, so the SDK's final message has it)."""

    def __init__(self, req: GenerationRequest, job_id: str, created: int = 0) -> None:
        self.req, self.job_id = req, job_id
        self.started, self.output_tokens = False, 0

    def step(self, ev: Tokens | Done) -> list[bytes]:
        out = []
        new_tokens = sum(len(d.token_ids) for d in ev.deltas)
        self.output_tokens += new_tokens
        if not self.started:
            self.started = True
            opening = Message(id=f"msg_{self.job_id}", content=[], model=self.req.model, stop_reason=None,
                              stop_sequence=None,
                              usage=Usage(input_tokens=0, output_tokens=new_tokens,
                                          service_tier=reported_tier(self.req)))
            out += [event("message_start", MessageStart(message=opening)),
                    event("content_block_start", ContentBlockStart(content_block=TextBlock(text=""))),
                    event("ping", Ping())]
        text = "".join(d.text for d in ev.deltas)
        if text:
            out.append(event("content_block_delta", ContentBlockDelta(delta=TextDelta(text=text))))
        if isinstance(ev, Done):
            last = ev.deltas[-1] if ev.deltas else None
            finish = next((d for d in reversed(ev.deltas) if d.finish_reason is not None), last)
            stop_reason, stop_sequence = stop_of(finish.finish_reason if finish else None,
                                                 finish.stop_reason if finish else None)
            usage = DeltaUsage(input_tokens=ev.usage.prompt_tokens, output_tokens=ev.usage.completion_tokens)
            out += [event("content_block_stop", ContentBlockStop()),
                    event("message_delta", MessageDelta(delta=StopDelta(stop_reason=stop_reason,
                                                                        stop_sequence=stop_sequence), usage=usage)),
                    event("message_stop", MessageStop())]
        return out

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
