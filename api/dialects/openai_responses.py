"""OpenAI's Responses API: ``POST /v1/responses`` and its background reads (``/v1/responses/{id}``).

A response is one llmq job: its id is ``resp_`` + the job id and its output message's id is
``msg_`` + the job id, so every durable thing about it (status, result, events) is the job's own
record and event log. ``input`` becomes a chat (``instructions`` first, as a system message),
rendered with the model's chat template by the worker.

A stream is SSE with ``event: <type>`` lines and ``sequence_number`` on every event (0, 1, 2, ...),
and no ``[DONE]``: OpenAI's server ends a Responses stream by closing it after the terminal event
(the openai SDK stops on the close). The numbering is a pure function of the job's event log: the
four opening events are 0..3, job event ``k`` (1-based) is the one ``response.output_text.delta``
numbered ``3 + k``, and the closing events follow the terminal event's number. So a stream resumed
with ``starting_after=N`` is the same events re-rendered from the log, those numbered above N.

Fields that the job record does not keep (``metadata``, ``instructions``, ``user``, the schema's
``name``, ...) are echoed on the answer to the POST and in its stream; a response read back later
(``GET /v1/responses/{id}``, ``GET /v1/jobs/{id}``) shows what the job record holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from api.dialects.common import ErrorObject, ErrorResponse, refuse
from api.dialects.openai_structured import JsonSchemaFormat, ResponseFormat, structured_output
from api.dialects.stream import SseKeepalive, StreamRenderer
from api.dialects.tiers import priority_of_tier, reported_tier
from shared.errors import InternalError, InvalidRequest, JobCancelled, Overloaded, ServiceError
from shared.events import Done, Error, Tokens
from shared.framing import sse
from shared.schemas import (
    ChatMessage,
    GenerationRequest,
    JobRecord,
    JobResult,
    OutputOptions,
    Reported,
    SamplingParams,
    Usage,
)

__all__ = [
    "NAME",
    "RESPONSE_PREFIX",
    "ResponsesRequest",
    "Echo",
    "Response",
    "to_generation_request",
    "echo_of_body",
    "echo_of_request",
    "history_of",
    "render_response",
    "render_result",
    "render_finished",
    "render_record",
    "ResponseStream",
    "stream",
    "render_input_items",
    "Deleted",
    "error_body",
    "job_id_of",
]

NAME = "openai_responses"
RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
OPENING_EVENTS = 4
"""``response.created``, ``.in_progress``, ``.output_item.added``, ``.content_part.added``: 0..3."""

# --- the request ----------------------------------------------------------------------------


class InputContent(msgspec.Struct, kw_only=True):
    """One content part; only text parts are honoured (``output_text`` is an earlier assistant turn
    sent back, as the SDK does). Other types are refused by name."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message item: ``{"role", "content"}`` (EasyInputMessage) or with ``type: "message"``."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):  # echoed as sent: no added nulls
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's create-response body. Unknown fields are accepted (as OpenAI-compatible servers do);
    fields that ask for what this server cannot do are refused (``_refusals``), never ignored."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    service_tier: str | None = None
    user: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


def _refusals(b: ResponsesRequest) -> None:
    refuse(bool(b.tools), "tools are not supported by this server", "tools")
    forced = b.tool_choice not in (None, "none", "auto")
    refuse(forced, "tool_choice needs tools, which are not supported by this server", "tool_choice")
    effort = b.reasoning.effort if b.reasoning is not None else None
    refuse(effort not in (None, "none"), f"reasoning.effort {effort!r} is not supported: this model does not "
            "reason with an effort setting", "reasoning.effort")
    summary = b.reasoning is not None and (b.reasoning.summary or b.reasoning.generate_summary)
    refuse(bool(summary), "reasoning summaries are not supported by this model", "reasoning.summary")
    refuse(b.conversation is not None, "conversation is not supported by this server", "conversation")
    refuse(b.prompt is not None, "prompt templates (`prompt`) are not supported by this server", "prompt")
    refuse(bool(b.top_logprobs), "top_logprobs is not supported by this server", "top_logprobs")
    refuse(b.truncation not in (None, "disabled"), "truncation 'auto' is not supported: an input too long for "
            "the model is refused", "truncation")
    refuse(bool(b.background) and b.store is False, "background responses need store=true", "background")


# Roles a message item may have; ``developer`` is OpenAI's newer name for the system role, and is
# sent to the chat template as ``system`` (templates know that one).
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


def _content(item: InputItem, i: int) -> str:
    if item.content is None or isinstance(item.content, str):
        return item.content or ""
    texts = []
    for j, part in enumerate(item.content):
        refuse(part.type not in _TEXT_PARTS, f"input[{i}].content[{j}]: content of type {part.type!r} is not "
                "supported (text only)", f"input[{i}].content[{j}].type")
        refuse(part.text is None, f"input[{i}].content[{j}]: a text part needs `text`", f"input[{i}].content[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def _messages(b: ResponsesRequest, history: Sequence[ChatMessage] = ()) -> list[ChatMessage]:
    # This request's instructions first (a previous response's never carry over, as OpenAI's
    # rule is), then the conversation so far, then this input.
    out = [ChatMessage(role="system", content=b.instructions)] if b.instructions is not None else []
    out += history
    refuse(b.input is None, "input is required", "input")
    if isinstance(b.input, str):
        return [*out, ChatMessage(role="user", content=b.input)]
    refuse(not b.input, "input must not be empty", "input")
    for i, item in enumerate(b.input or ()):
        refuse(item.type != "message", f"input[{i}]: items of type {item.type!r} are not supported (message "
                "items only)", f"input[{i}].type")
        role = _ROLES.get(item.role or "")
        refuse(role is None, f"input[{i}]: role must be one of {sorted(_ROLES)}, got {item.role!r}",
                f"input[{i}].role")
        out.append(ChatMessage(role=role or "", content=_content(item, i)))
    return out


def _structured(fmt: TextFormat | None):
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return structured_output(None, ResponseFormat(type="json_object"))
    refuse(fmt.type != "json_schema", f"text.format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{fmt.type!r}", "text.format.type")
    refuse(not fmt.name, "text.format.name is required for json_schema", "text.format.name")
    refuse(fmt.schema is None, "text.format.schema is required for json_schema", "text.format.schema")
    schema = JsonSchemaFormat(name=fmt.name or "", description=fmt.description, schema=fmt.schema, strict=fmt.strict)
    return structured_output(None, ResponseFormat(type="json_schema", json_schema=schema))


def history_of(previous: GenerationRequest, result: JobResult) -> list[ChatMessage]:
    """The conversation a response continues from (``previous_response_id``): the previous one's
    input without its own instructions, then its output as the assistant's turn."""
    messages = list(previous.messages or ())
    kept = previous.output.reported
    if kept is not None and kept.instructions is not None and messages and messages[0].role == "system" \
            and messages[0].content == kept.instructions:
        messages = messages[1:]
    text = result.choices[0].text if result.choices else ""
    return [*messages, ChatMessage(role="assistant", content=text)]


def to_generation_request(body: ResponsesRequest, *, max_model_len: int,
                          history: Sequence[ChatMessage] = ()) -> GenerationRequest:
    """A null ``max_output_tokens`` means "up to the context", as chat's null ``max_tokens``; a
    larger one than the context holds is clamped by the worker, as every dialect's ``max_tokens``
    (shared/budget.py). ``history``: the conversation of ``previous_response_id`` (:func:`history_of`)."""
    _refusals(body)
    asked = body.max_output_tokens
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_model_len - 1 if asked is None else asked,
        structured=_structured(body.text.format if body.text is not None else None),
    )
    # The tier named and the settings the answer repeats are kept with the job, so a response read
    # back later (a poll, a resumed stream) reports them too.
    fmt = body.text.format if body.text is not None else None
    reported = Reported(instructions=body.instructions, metadata=body.metadata or {}, user=body.user,
                        format_name=fmt.name if fmt is not None and fmt.type == "json_schema" else None,
                        background=bool(body.background), store=body.store is not False,
                        previous_response_id=body.previous_response_id)
    return GenerationRequest(model=body.model or "", messages=_messages(body, history), sampling=sampling, dialect=NAME,
                             priority=priority_of_tier(body.service_tier),
                             output=OutputOptions(service_tier=body.service_tier, reported=reported))


# --- what a response echoes -------------------------------------------------------------------


class Echo(msgspec.Struct, kw_only=True):
    """The request's settings as a response object reports them."""

    model: str
    background: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text_format: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "text"})
    user: str | None = None
    previous_response_id: str | None = None


def _tier_name(tier: str | None) -> str:
    """The tier the request ran at, as OpenAI reports it: ``auto`` and none run at ``default``."""
    return reported_tier(tier) or "default"


def echo_of_body(body: ResponsesRequest, model: str) -> Echo:
    fmt = body.text.format if body.text is not None else None
    return Echo(
        model=model,
        background=bool(body.background),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        service_tier=_tier_name(body.service_tier),
        store=body.store is not False,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        text_format=msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"},
        user=body.user,
        previous_response_id=body.previous_response_id,
    )


def echo_of_request(req: GenerationRequest, *, background: bool = False) -> Echo:
    """What a stored job tells of its request: sampling, format, tier, and the settings kept for
    its answers (:class:`Reported`; a job queued before they were kept has none)."""
    kept = req.output.reported or Reported(background=background)
    s = req.sampling.structured
    fmt: dict[str, Any] = {"type": "text"}
    if s is not None and s.json_object:
        fmt = {"type": "json_object"}
    elif s is not None and s.json is not None:
        named = {"name": kept.format_name} if kept.format_name is not None else {}
        fmt = {"type": "json_schema", **named, "schema": s.json, "strict": True}
    return Echo(model=req.model, background=kept.background, instructions=kept.instructions,
                max_output_tokens=req.sampling.max_tokens, metadata=dict(kept.metadata),
                service_tier=_tier_name(req.output.service_tier), store=kept.store,
                temperature=req.sampling.temperature, top_p=req.sampling.top_p, text_format=fmt, user=kept.user,
                previous_response_id=kept.previous_response_id)


# --- response objects -------------------------------------------------------------------------
# Named after the openai SDK's types (openai/types/responses/); field order is OpenAI's on the wire.

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class OutputText(msgspec.Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    type: str = "message"
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the SDK's InputTokensDetails requires it


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class Reasoning(msgspec.Struct, kw_only=True):
    effort: None = None
    summary: None = None


class Text(msgspec.Struct, kw_only=True):
    format: dict[str, Any]


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: Status
    background: bool
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False  # no tools here: never any tool call, parallel or not
    previous_response_id: str | None = None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    service_tier: str
    store: bool
    temperature: float
    text: Text
    tool_choice: str = "none"
    tools: list[Any] = []
    top_logprobs: int = 0
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]


def response_id(job_id: str) -> str:
    return RESPONSE_PREFIX + job_id


def job_id_of(resp_id: str) -> str | None:
    """The job behind a response id; None for an id this server never gave out."""
    return resp_id.removeprefix(RESPONSE_PREFIX) if resp_id.startswith(RESPONSE_PREFIX) else None


def usage_of(usage: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(),
                         output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=usage.prompt_tokens + usage.completion_tokens)


# llmq's errors in the SDK's ResponseError.code vocabulary: the model's own failures are
# ``server_error``; a prompt the engine refused (too long for the context) is ``invalid_prompt``.
_FAILURE_CODES: tuple[tuple[type[ServiceError], str], ...] = (
    (InvalidRequest, "invalid_prompt"), (Overloaded, "rate_limit_exceeded"))


def response_error(exc: ServiceError) -> ResponseError:
    code = next((name for cls, name in _FAILURE_CODES if isinstance(exc, cls)), "server_error")
    return ResponseError(code=code, message=exc.message)


def render_response(echo: Echo, job_id: str, created: int, status: Status, *, text: str | None = None,
                    usage: Usage | None = None, error: ServiceError | None = None) -> Response:
    """The response object in any state: ``text`` is the output message's (None: no output yet)."""
    output = []
    if text is not None:
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [OutputMessage(id=MESSAGE_PREFIX + job_id, status=item_status, content=[OutputText(text=text)])]
    return Response(
        id=response_id(job_id), created_at=created, status=status, background=echo.background,
        error=response_error(error) if error is not None else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=echo.instructions, max_output_tokens=echo.max_output_tokens, model=echo.model, output=output,
        service_tier=echo.service_tier, store=echo.store, temperature=echo.temperature,
        text=Text(format=echo.text_format), top_p=echo.top_p, usage=usage_of(usage) if usage is not None else None,
        user=echo.user, metadata=echo.metadata, previous_response_id=echo.previous_response_id,
    )


def finished_status(finish_reason: str | None) -> Status:
    """``length``: the output stopped at ``max_output_tokens`` (or the context's end)."""
    return "incomplete" if finish_reason == "length" else "completed"


def render_finished(echo: Echo, result: JobResult, job_id: str, created: int) -> Response:
    choice = result.choices[0] if result.choices else None
    status = finished_status(choice.finish_reason if choice else None)
    return render_response(echo, job_id, created, status, text=choice.text if choice else "", usage=result.usage)


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Response:
    """The Dialect hook (``GET /v1/jobs/{id}``, webhooks): a finished job from its record alone."""
    return render_finished(echo_of_request(req), result, job_id, created)


def render_record(record: JobRecord, *, echo: Echo | None = None) -> Response:
    """A response read back from its job record, in whatever state the job is; ``echo``: the
    request's settings when the body is at hand (else what the record keeps)."""
    echo = echo if echo is not None else echo_of_request(record.request)
    created = int(record.queued_at // 1000)
    if record.cancel and record.status in ("queued", "running"):
        # Flagged: a queued job never starts, a running one is aborted at its next step.
        return render_response(echo, record.id, created, "cancelled")
    match record.status:
        case "done":
            return render_finished(echo, record.result or JobResult(), record.id, created)
        case "cancelled":
            return render_response(echo, record.id, created, "cancelled")
        case "failed":
            exc = record.error.exception() if record.error else InternalError("the response failed")
            return render_response(echo, record.id, created, "failed", error=exc)
        case "running":
            return render_response(echo, record.id, created, "in_progress")
    return render_response(echo, record.id, created, "queued")


# --- input items ------------------------------------------------------------------------------


class InputText(msgspec.Struct, kw_only=True):
    type: str = "input_text"
    text: str


class InputMessageItem(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str
    content: list[InputText]
    status: str = "completed"


class ItemList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[InputMessageItem]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


def render_input_items(req: GenerationRequest, job_id: str) -> ItemList:
    """The stored request's messages as input items, newest first (OpenAI's default order ``desc``).
    Item ids are ``msg_<job id>_<index>``: stable, so a client can page or compare them."""
    items = [InputMessageItem(id=f"{MESSAGE_PREFIX}{job_id}_{i}", role=m.role, content=[InputText(text=m.content)])
             for i, m in enumerate(req.messages or ())][::-1]
    return ItemList(data=items, first_id=items[0].id if items else None, last_id=items[-1].id if items else None)


class Deleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


# --- streaming --------------------------------------------------------------------------------


class StreamResponse(msgspec.Struct, kw_only=True):
    """``response.created`` / ``.in_progress`` / ``.completed`` / ``.incomplete`` / ``.failed``."""

    type: str
    sequence_number: int
    response: Response


class ItemEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    output_index: int = 0
    item: OutputMessage


class PartEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int = 0
    content_index: int = 0
    part: OutputText


class TextDelta(msgspec.Struct, kw_only=True):
    type: str = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class TextDone(msgspec.Struct, kw_only=True):
    type: str = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int = 0
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ErrorEvent(msgspec.Struct, kw_only=True):
    """OpenAI's in-band ``error`` event: the stream itself broke (not the job)."""

    type: str = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None = None


def frame(event: msgspec.Struct) -> bytes:
    """One event as OpenAI frames it: its type as the SSE ``event:`` name, then the JSON."""
    return sse(event, event=event.type)  # type: ignore[attr-defined]


def delta_seq(job_seq: int) -> int:
    """The ``sequence_number`` of job event ``job_seq``'s delta (and of a terminal error's event)."""
    return OPENING_EVENTS - 1 + job_seq


def opening_events(echo: Echo, job_id: str, created: int) -> list[msgspec.Struct]:
    item_id = MESSAGE_PREFIX + job_id
    start = "queued" if echo.background else "in_progress"
    return [
        StreamResponse(type="response.created", sequence_number=0,
                       response=render_response(echo, job_id, created, start)),
        StreamResponse(type="response.in_progress", sequence_number=1,
                       response=render_response(echo, job_id, created, "in_progress")),
        ItemEvent(type="response.output_item.added", sequence_number=2,
                  item=OutputMessage(id=item_id, status="in_progress", content=[])),
        PartEvent(type="response.content_part.added", sequence_number=3, item_id=item_id, part=OutputText(text="")),
    ]


def closing_events(echo: Echo, job_id: str, created: int, done: Done, text: str,
                   finish_reason: str | None) -> list[msgspec.Struct]:
    item_id, seq = MESSAGE_PREFIX + job_id, delta_seq(done.seq)
    status = finished_status(finish_reason)
    final = render_response(echo, job_id, created, status, text=text, usage=done.usage)
    item = final.output[0]
    return [
        TextDone(sequence_number=seq + 1, item_id=item_id, text=text),
        PartEvent(type="response.content_part.done", sequence_number=seq + 2, item_id=item_id,
                  part=OutputText(text=text)),
        ItemEvent(type="response.output_item.done", sequence_number=seq + 3, item=item),
        StreamResponse(type=f"response.{status}", sequence_number=seq + 4, response=final),
    ]


def failed_event(echo: Echo, job_id: str, created: int, error: Error) -> StreamResponse:
    """A job that ended with an error: ``response.failed``; a cancelled job's object says
    ``cancelled`` (OpenAI's stream has no event of its own for it)."""
    exc = error.exception()
    cancelled = isinstance(exc, JobCancelled)
    response = render_response(echo, job_id, created, "cancelled" if cancelled else "failed",
                               error=None if cancelled else exc)
    return StreamResponse(type="response.failed", sequence_number=delta_seq(error.seq), response=response)


class ResponseStream(SseKeepalive, StreamRenderer[bytes]):
    """The job's events as OpenAI's stream; only events numbered above ``starting_after`` are sent
    (all of them are rendered: the closing ones carry the whole text). The events must start at
    the job's first event."""

    def __init__(self, echo: Echo, job_id: str, created: int, *, starting_after: int = -1) -> None:
        self.echo, self.job_id, self.created, self.after = echo, job_id, created, starting_after
        self.item_id = MESSAGE_PREFIX + job_id
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.last = OPENING_EVENTS - 1

    def _frames(self, events: list[msgspec.Struct]) -> list[bytes]:
        return [frame(e) for e in events if e.sequence_number > self.after]  # type: ignore[attr-defined]

    def open(self) -> list[bytes]:
        return self._frames(opening_events(self.echo, self.job_id, self.created))

    def step(self, ev: Tokens | Done) -> list[bytes]:
        delta = "".join(d.text for d in ev.deltas)
        self.parts.append(delta)
        self.finish_reason = next((d.finish_reason for d in ev.deltas if d.finish_reason), self.finish_reason)
        self.last = delta_seq(ev.seq)
        events: list[msgspec.Struct] = [TextDelta(sequence_number=self.last, item_id=self.item_id, delta=delta)]
        if isinstance(ev, Done):
            events += closing_events(self.echo, self.job_id, self.created, ev, "".join(self.parts),
                                     self.finish_reason)
        return self._frames(events)

    def failed(self, error: Error) -> list[bytes]:
        return [frame(failed_event(self.echo, self.job_id, self.created, error))]

    def fail(self, exc: ServiceError) -> list[bytes]:
        """The relay failed (Redis went away mid-stream): the stream broke, not the job."""
        return [frame(ErrorEvent(sequence_number=self.last + 1, code=exc.code, message=exc.message))]


def stream(req: GenerationRequest, job_id: str, created: int) -> ResponseStream:
    return ResponseStream(echo_of_request(req), job_id, created)


# --- errors -----------------------------------------------------------------------------------


_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's ``type``: ``invalid_request_error`` for the client's mistakes, ``server_error`` for ours."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(exc: ServiceError) -> tuple[int, ErrorResponse]:
    error = ErrorObject(message=exc.message, type=error_type(exc.status), param=exc.param, code=exc.code)
    return exc.status, ErrorResponse(error=error)

