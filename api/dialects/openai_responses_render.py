"""OpenAI Responses' side of the wire going out: the response object, its output items and the
input items list (:mod:`api.dialects.openai_responses` is the side coming in: the request and its
translation; :mod:`api.dialects.openai_responses_stream` the numbered stream events).

A response is one llmq job, and every id in it is derived from the job's id, so a response read
back or replayed anywhere names the same things: the response ``resp_<job>``, its reasoning item
``rs_<job>``, its message ``msg_<job>``, and a function call ``fc_<job>_<i>`` whose ``call_id`` is
the worker's ``call_<job>_<i>`` (deterministic per job: workers/parsing.py).

**Output.** The reasoning item (when the model's reasoning came apart from its answer), then the
message (when there is content, or nothing else), then one ``function_call`` item per call. A
call to a function of a ``namespace`` tool carries that function's own name and the namespace
(the model saw ``<namespace>__<name>``, vLLM's flat name).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.tiers import reported_tier
from shared.errors import InternalError, InvalidRequest, Overloaded, ServiceError
from shared.events import ToolCallDelta
from shared.schemas import (
    ChatMessage,
    Choice,
    GenerationRequest,
    Image,
    JobRecord,
    JobResult,
    Reported,
    ToolCall,
    Usage,
)

__all__ = [
    "RESPONSE_PREFIX",
    "NAMESPACE_SEPARATOR",
    "Echo",
    "Status",
    "echo_of_request",
    "echo_of_settings",
    "tier_name",
    "flat_name",
    "namespaced_names",
    "Response",
    "response_id",
    "job_id_of",
    "render_response",
    "render_finished",
    "render_result",
    "render_record",
    "ItemList",
    "render_input_items",
    "Deleted",
]

RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
REASONING_PREFIX = "rs_"
CALL_PREFIX = "fc_"
NAMESPACE_SEPARATOR = "__"
"""A namespace's function is offered to the model as ``<namespace>__<name>`` (vLLM's
``flat_namespace_tool_name``)."""


# --- names of namespaced functions ------------------------------------------------------------


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def namespaced_names(tools: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """The flat name of each function of a ``namespace`` tool -> (its namespace, its own name)."""
    names: dict[str, tuple[str, str]] = {}
    for tool in tools:
        namespace, nested = tool.get("name"), tool.get("tools")
        if tool.get("type") != "namespace" or not isinstance(namespace, str) or not isinstance(nested, list):
            continue
        for function in nested:
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(function, dict) and function.get("type") == "function" and isinstance(name, str):
                names[flat_name(namespace, name)] = (namespace, name)
    return names


# --- what a response echoes -------------------------------------------------------------------


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


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
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = False
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)


def tier_name(tier: str | None) -> str:
    """The tier the request ran at, as OpenAI reports it: ``auto`` and none run at ``default``."""
    return reported_tier(tier) or "default"


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool in OpenAI's full form (the SDK's ``FunctionTool`` has every key, null when
    not sent); any other tool as sent."""
    if tool.get("type") != "function":
        return tool
    return {"type": "function", "name": tool.get("name"), "description": None, "parameters": None, "strict": None,
            **tool}


def echo_of_settings(kept: Reported) -> dict[str, Any]:
    """The tool and reasoning settings a response reports, from what was sent: ``tools`` all of
    them (hosted ones too); ``tool_choice`` and ``parallel_tool_calls`` as sent, else ``auto`` and
    true with tools, ``none`` and false without (nothing could be called)."""
    tools = [_echoed_tool(t) for t in kept.tools or ()]
    choice = kept.tool_choice if kept.tool_choice is not None else ("auto" if tools else "none")
    parallel = kept.parallel_tool_calls if kept.parallel_tool_calls is not None else bool(tools)
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "reasoning": Reasoning(effort=kept.reasoning_effort, summary=kept.reasoning_summary)}


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
    return Echo(model=req.served_name, background=kept.background, instructions=kept.instructions,
                max_output_tokens=req.sampling.max_tokens, metadata=dict(kept.metadata),
                service_tier=tier_name(req.output.service_tier), store=kept.store,
                temperature=req.sampling.temperature, top_p=req.sampling.top_p, text_format=fmt, user=kept.user,
                previous_response_id=kept.previous_response_id, **echo_of_settings(kept))


# --- response objects -------------------------------------------------------------------------
# Named after the openai SDK's types (openai/types/responses/); field order is OpenAI's on the wire.

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """vLLM's reasoning item: the text as ``reasoning_text`` content, no summary (none is made),
    no ``encrypted_content`` (nothing is encrypted: the text is all there is)."""

    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: str


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    namespace: str | UnsetType = UNSET  # only for a namespace tool's function
    arguments: str
    status: str


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


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
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: Reasoning
    service_tier: str
    store: bool
    temperature: float
    text: Text
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
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


def call_item_id(call_id: str) -> str:
    """``fc_`` + the part of the call's id after ``call_`` (``call_<job>_<i>`` -> ``fc_<job>_<i>``)."""
    return CALL_PREFIX + call_id.removeprefix("call_")


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


def function_call_item(call: ToolCall | ToolCallDelta, arguments: str, status: str,
                       names: dict[str, tuple[str, str]]) -> FunctionCallItem:
    """A call as its output item; a namespaced function's flat name goes back to its own name."""
    call_id, name = call.id or "", call.name or ""
    namespace, own = names.get(name, (UNSET, name))
    return FunctionCallItem(id=call_item_id(call_id), call_id=call_id, name=own, namespace=namespace,
                            arguments=arguments, status=status)


def output_of(echo: Echo, job_id: str, choice: Choice, status: Status) -> list[OutputItem]:
    """A finished choice's output items, in OpenAI's order: the reasoning, the message (when it
    has content, or nothing else was output), the calls. The last is ``incomplete`` when the
    response is (the output stopped there); the others are whole."""
    calls = choice.tool_calls or []
    names = namespaced_names(echo.tools)
    items: list[OutputItem] = []
    if choice.reasoning:
        items.append(ReasoningItem(id=REASONING_PREFIX + job_id, content=[ReasoningText(text=choice.reasoning)],
                                   status="completed"))
    if choice.text or not items and not calls:
        items.append(OutputMessage(id=MESSAGE_PREFIX + job_id, status="completed",
                                   content=[OutputText(text=choice.text)]))
    items += [function_call_item(call, call.arguments, "completed", names) for call in calls]
    if status == "incomplete":
        items[-1].status = "incomplete"
    return items


def render_response(echo: Echo, job_id: str, created: int, status: Status, *, choice: Choice | None = None,
                    usage: Usage | None = None, error: ServiceError | None = None) -> Response:
    """The response object in any state: ``choice`` is the finished output (None: no output yet)."""
    return Response(
        id=response_id(job_id), created_at=created, status=status, background=echo.background,
        error=response_error(error) if error is not None else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=echo.instructions, max_output_tokens=echo.max_output_tokens, model=echo.model,
        output=output_of(echo, job_id, choice, status) if choice is not None else [],
        parallel_tool_calls=echo.parallel_tool_calls, reasoning=echo.reasoning, service_tier=echo.service_tier,
        store=echo.store, temperature=echo.temperature, text=Text(format=echo.text_format),
        tool_choice=echo.tool_choice, tools=echo.tools, top_p=echo.top_p,
        usage=usage_of(usage) if usage is not None else None, user=echo.user, metadata=echo.metadata,
        previous_response_id=echo.previous_response_id,
    )


def finished_status(finish_reason: str | None) -> Status:
    """``length``: the output stopped at ``max_output_tokens`` (or the context's end)."""
    return "incomplete" if finish_reason == "length" else "completed"


def render_finished(echo: Echo, result: JobResult, job_id: str, created: int) -> Response:
    choice = result.choices[0] if result.choices else Choice()
    return render_response(echo, job_id, created, finished_status(choice.finish_reason), choice=choice,
                           usage=result.usage)


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


class InputText(msgspec.Struct, kw_only=True, tag="input_text", tag_field="type"):
    text: str


class InputImage(msgspec.Struct, kw_only=True, tag="input_image", tag_field="type"):
    """A stored turn's image. A queued job keeps an image by its hash, not by the URL it came as
    (shared/schemas.py ``Image``), so ``image_url`` is null once the image was read."""

    detail: str = "auto"
    image_url: str | None = None
    file_id: str | None = None


class InputMessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    """A stored turn's message: an assistant's with ``output_text`` (the output it once was)."""

    id: str
    role: str
    content: list[InputText | InputImage | OutputText]
    status: str = "completed"


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, tag="function_call_output", tag_field="type"):
    id: str
    call_id: str
    output: str | list[InputText | InputImage]
    """Text, or (a result with images) its texts and images in order."""
    status: str = "completed"


ListedItem = InputMessageItem | ReasoningItem | FunctionCallItem | FunctionCallOutputItem


class ItemList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ListedItem]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


def _input_parts(m: ChatMessage) -> list[InputText | InputImage]:
    """A turn with images as its input parts, in order."""
    return [InputImage(detail=p.detail or "auto", image_url=p.url) if isinstance(p, Image) else InputText(text=p.text)
            for p in m.parts]


def _listed(m: ChatMessage, ref: str, names: dict[str, tuple[str, str]]) -> list[ListedItem]:
    """One stored turn as input items: a tool result as its ``function_call_output``; an
    assistant turn as its reasoning, its message and its calls (as the output it once was)."""
    if m.role == "tool":
        output: str | list[InputText | InputImage] = _input_parts(m) if m.parts else m.content
        return [FunctionCallOutputItem(id=f"fco_{ref}", call_id=m.tool_call_id or "", output=output)]
    if m.role != "assistant":
        content: list[InputText | InputImage | OutputText] = [*_input_parts(m)] if m.parts else \
            [InputText(text=m.content)]
        return [InputMessageItem(id=MESSAGE_PREFIX + ref, role=m.role, content=content)]
    items: list[ListedItem] = []
    if m.reasoning:
        items.append(ReasoningItem(id=REASONING_PREFIX + ref, content=[ReasoningText(text=m.reasoning)],
                                   status="completed"))
    if m.content or not items and not m.tool_calls:
        items.append(InputMessageItem(id=MESSAGE_PREFIX + ref, role="assistant", content=[OutputText(text=m.content)]))
    for k, call in enumerate(m.tool_calls):
        item = function_call_item(call, call.arguments, "completed", names)
        items.append(msgspec.structs.replace(item, id=f"{CALL_PREFIX}{ref}_{k}"))
    return items


def render_input_items(req: GenerationRequest, job_id: str) -> ItemList:
    """The stored request's chat as input items, newest first (OpenAI's default order ``desc``).
    Ids name the turn they come from, ``<prefix><job id>_<turn>`` (a call ``fc_<job>_<turn>_<k>``,
    a tool result ``fco_<job>_<turn>``): stable, so a client can page or compare them."""
    names = namespaced_names((req.output.reported or Reported()).tools or [])
    items = [item for i, m in enumerate(req.messages or ()) for item in _listed(m, f"{job_id}_{i}", names)][::-1]
    return ItemList(data=items, first_id=items[0].id if items else None, last_id=items[-1].id if items else None)


class Deleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True
