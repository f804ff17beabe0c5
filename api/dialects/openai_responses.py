"""OpenAI's Responses API: ``POST /v1/responses`` and its background reads (``/v1/responses/{id}``).

This module is the side of the wire coming in: the create body and its translation into a chat
job, and OpenAI's error shape; the side going out is :mod:`api.dialects.openai_responses_render`
(the response object, its items) and :mod:`api.dialects.openai_responses_stream` (the numbered
stream), re-exported here, so this module is the dialect.

A response is one llmq job (``resp_`` + the job id). ``input`` becomes a chat (``instructions``
first, as a system message), rendered with the model's chat template by the worker:

- message items keep their roles (``developer`` too: the template renders it, as vLLM's does);
- ``function_call`` items become an assistant turn's tool calls (consecutive ones, and a
  reasoning item or assistant message next to them, make one assistant turn, vLLM's rule), and
  ``function_call_output`` items ``tool`` turns naming their ``call_id``;
- images: ``input_image`` parts (``image_url``: an http(s) URL or a ``data:`` URL; ``detail``
  ``auto``, ``low`` or ``high``) in a ``user`` message's content, and in a
  ``function_call_output``'s ``output`` list (``input_text`` and ``input_image`` items: what
  Codex's ``view_image`` tool returns). Only their shape is checked here (admission, api/media.py,
  reads them); ``file_id`` (llmq has no files API), an image in another role, and any other
  non-text part are a 400. Text parts are joined with newlines, as vLLM joins them: content
  without an image is that text (``content``), as it always was; with one it is the turn's
  ``parts`` in order (``content`` empty), consecutive text parts joined with newlines into one,
  each image in place between them;
- a ``reasoning`` item's text is the reasoning of its assistant turn (``encrypted_content`` is
  ignored: this server never makes any);
- function tools are offered to the model, a ``namespace`` tool's functions as
  ``<namespace>__<name>``; hosted tools (``web_search``, ``file_search``, ``mcp``, ``custom``, ...)
  are left out, and only echoed back;
- ``reasoning.effort`` reaches the chat template as ``reasoning_effort`` (and ``enable_thinking``,
  false for ``none``), as vLLM passes it.

Fields that the job does not use but its answers repeat (``metadata``, ``instructions``, the tools
as sent, ...) are kept with the job (``OutputOptions.reported``), so a response read back later
(``GET /v1/responses/{id}``, a resumed stream, ``GET /v1/jobs/{id}``) says what its first answer said.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from api.dialects.common import ErrorObject, ErrorResponse, content_of, refuse, tool_use, url_image
from api.dialects.openai_responses_render import (
    RESPONSE_PREFIX,
    Deleted,
    Echo,
    ItemList,
    Response,
    echo_of_request,
    echo_of_settings,
    flat_name,
    job_id_of,
    namespaced_names,
    render_finished,
    render_input_items,
    render_record,
    render_response,
    render_result,
    response_id,
    tier_name,
)
from api.dialects.openai_responses_stream import ResponseStream, stream
from api.dialects.openai_structured import JsonSchemaFormat, ResponseFormat, structured_output
from api.dialects.tiers import priority_of_tier
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    GenerationRequest,
    Image,
    JobResult,
    OutputOptions,
    Part,
    Reported,
    SamplingParams,
    Text,
    Tool,
    ToolCall,
    ToolUse,
    ToolUseChoice,
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
    "response_id",
    "render_response",
    "render_result",
    "render_finished",
    "render_record",
    "ResponseStream",
    "stream",
    "ItemList",
    "render_input_items",
    "Deleted",
    "ErrorResponse",
    "error_body",
    "job_id_of",
]

NAME: Final = "openai_responses"

# --- the request ----------------------------------------------------------------------------


class InputContent(msgspec.Struct, kw_only=True):
    """One content part: text (``output_text`` is an earlier assistant turn sent back, as the SDK
    does; ``reasoning_text`` and ``summary_text`` a reasoning item's), or an ``input_image`` where
    an image may be (the module's docstring). Other types are refused by name."""

    type: str
    text: str | None = None
    image_url: str | None = None
    """An ``input_image``'s: an http(s) URL or a ``data:`` URL."""
    detail: str | None = None
    file_id: str | None = None
    """Refused: llmq has no files API."""


class InputItem(msgspec.Struct, kw_only=True):
    """One ``input`` item: a message (``{"role", "content"}``, EasyInputMessage, or with ``type:
    "message"``), a ``function_call`` or ``function_call_output``, or a ``reasoning`` item. The
    fields of all of them; each type reads its own (:class:`_Chat`)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    summary: list[InputContent] | None = None
    encrypted_content: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):  # echoed as sent: no added nulls
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: Effort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None
    """The older name of ``summary``."""


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
    prompt_cache_key: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    """What the client's requests share (Codex sends its session's): their jobs' prefix key, so a
    conversation's turns go to the worker that holds its prefix (shared/affinity.py)."""
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    """Accepted, and changes nothing: ``reasoning.encrypted_content`` has nothing to add (the
    reasoning is all in the item's text), and no other inclusion is made."""
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


def _refusals(b: ResponsesRequest) -> None:
    refuse(b.conversation is not None, "conversation is not supported by this server", "conversation")
    refuse(b.prompt is not None, "prompt templates (`prompt`) are not supported by this server", "prompt")
    refuse(bool(b.top_logprobs), "top_logprobs is not supported by this server", "top_logprobs")
    refuse(b.truncation not in (None, "disabled"), "truncation 'auto' is not supported: an input too long for "
            "the model is refused", "truncation")
    refuse(bool(b.background) and b.store is False, "background responses need store=true", "background")


# --- tools ------------------------------------------------------------------------------------


class FunctionSpec(msgspec.Struct, kw_only=True):
    """A function tool (top-level, or inside a namespace); other keys (``defer_loading``, ...) are
    accepted and echoed, and change nothing."""

    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceSpec(msgspec.Struct, kw_only=True):
    type: str
    name: str
    description: str | None = None
    tools: list[dict[str, Any]] = []


def _spec(cls: type[FunctionSpec] | type[NamespaceSpec], raw: dict[str, Any], param: str):
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None


def _functions(tools: list[dict[str, Any]]) -> list[Tool]:
    """What the model is offered: the function tools, and each namespace's functions under their
    flat names; hosted tools (any other type, and a namespace's ``custom`` tools) are left out."""
    out = []
    for i, raw in enumerate(tools):
        if raw.get("type") == "function":
            f = _spec(FunctionSpec, raw, f"tools[{i}]")
            out.append(Tool(name=f.name, description=f.description, parameters=f.parameters, strict=f.strict))
        elif raw.get("type") == "namespace":
            ns = _spec(NamespaceSpec, raw, f"tools[{i}]")
            for j, nested in enumerate(ns.tools):
                if nested.get("type") == "function":
                    f = _spec(FunctionSpec, nested, f"tools[{i}].tools[{j}]")
                    out.append(Tool(name=flat_name(ns.name, f.name), description=f.description,
                                    parameters=f.parameters, strict=f.strict))
    return out


def _named(choice: dict[str, Any], functions: list[Tool], tools: list[dict[str, Any]]) -> str:
    """The flat name a ``{"type": "function", "name"}`` choice forces: with a ``namespace``, that
    namespace's function; else the name as given (a top-level function, or a flat name), or else
    the one namespace function of that name (vLLM's rule: more than one is ambiguous)."""
    name, namespace = choice.get("name"), choice.get("namespace")
    refuse(not isinstance(name, str), "tool_choice.name is required for a function choice", "tool_choice.name")
    assert isinstance(name, str)
    if isinstance(namespace, str):
        return flat_name(namespace, name)
    if any(t.name == name for t in functions):
        return name
    candidates = sorted(flat for flat, (_, own) in namespaced_names(tools).items() if own == name)
    refuse(len(candidates) > 1, f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.", "tool_choice")
    return candidates[0] if candidates else name


_STRING_CHOICES: dict[str | None, ToolUseChoice | None] = {None: None, "none": "none", "auto": "auto",
                                                           "required": "required"}
"""The choices ``tool_choice`` may name as a string (or leave out), as the internal form names them."""


def _choice(b: ResponsesRequest, functions: list[Tool]) -> tuple[ToolUseChoice | None, str | None]:
    """``tool_choice`` as (choice, forced function). Only function tools can be forced: a choice
    that forces a hosted tool could not be honoured (llmq cannot run it, and the model was not
    offered it), so it is a 400, not a silent ``auto``."""
    tc = b.tool_choice
    if tc is None or isinstance(tc, str):
        refuse(tc not in _STRING_CHOICES, f"tool_choice must be 'none', 'auto', 'required' or an object, got {tc!r}",
               "tool_choice")
        return _STRING_CHOICES[tc], None
    kind = tc.get("type")
    if kind == "function":
        return "function", _named(tc, functions, b.tools or [])
    refuse(kind == "allowed_tools", "tool_choice 'allowed_tools' is not supported by this server", "tool_choice")
    raise InvalidRequest(f"tool_choice forces the {kind!r} tool, which this server cannot run: only function "
                         "tools can be called here", param="tool_choice")


def _tools(b: ResponsesRequest) -> ToolUse | None:
    functions = _functions(b.tools or [])
    choice, forced = _choice(b, functions)
    if not functions:  # no tools, or hosted ones only: nothing the model can call
        refuse(choice not in (None, "none", "auto"), f"tool_choice {choice!r} needs a function tool, and `tools` "
                "offers none the model can call (hosted tools are left out)", "tool_choice")
        return None
    return tool_use(functions, choice, forced, parallel=b.parallel_tool_calls is not False)


# --- input ------------------------------------------------------------------------------------

# Roles a message item may have (``developer`` goes to the template as it is: shared/chat_template.py).
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_IMAGE_PARTS = (*_TEXT_PARTS, "input_image")
"""What a user message's content and a ``function_call_output``'s ``output`` list may hold."""


def _image(part: InputContent, at: str) -> Image:
    refuse(part.file_id is not None, f"{at}: an input_image by `file_id` is not supported (this server has no "
           "files API): send `image_url`, an http(s) URL or a data URL", f"{at}.file_id")
    refuse(part.image_url is None, f"{at}: an input_image needs `image_url`", f"{at}.image_url")
    return url_image(part.image_url or "", part.detail, url_at=f"{at}.image_url", detail_at=f"{at}.detail")


def _content(parts: str | list[InputContent] | None, where: str, kinds: Sequence[str] = _TEXT_PARTS,
             only: str = "text only") -> tuple[str, list[Part]]:
    """Content as a turn's ``content`` and ``parts``: a string, or its text parts joined with
    ``\\n`` (as vLLM joins them) and, where ``kinds`` has ``input_image``, its images in place (the
    module's docstring). ``only``: what the refusal of another kind says is allowed here."""
    if parts is None or isinstance(parts, str):
        return parts or "", []
    out: list[Part] = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        refuse(part.type not in kinds, f"{at}: content of type {part.type!r} is not supported ({only})", f"{at}.type")
        if part.type == "input_image":
            out.append(_image(part, at))
            continue
        refuse(part.text is None, f"{at}: a text part needs `text`", at)
        out.append(Text(text=part.text or ""))
    return content_of(out)


def _text(parts: str | list[InputContent] | None, where: str, kinds: Sequence[str] = _TEXT_PARTS,
          only: str = "text only") -> str:
    """Content that may only be text, as text (no ``kinds`` is an image)."""
    return _content(parts, where, kinds, only)[0]


class _Turn:
    """An assistant turn being put together from items (see :class:`_Chat`)."""

    def __init__(self) -> None:
        self.content: str | None = None
        self.reasoning: str | None = None
        self.calls: list[ToolCall] = []


class _Chat:
    """An input list as chat turns, merged as vLLM's ``construct_chat_messages_with_tool_call``
    merges them: a ``function_call`` joins the assistant turn just before it; a reasoning item
    or an assistant message fills that turn's reasoning or content when it has none yet; any
    other item is a turn of its own."""

    def __init__(self) -> None:
        self.turns: list[ChatMessage | _Turn] = []

    def _assistant(self, has: str | None = None) -> _Turn:
        """The assistant turn an item joins: the last turn when it is one (and its ``has`` field
        is still empty), else a new one."""
        last = self.turns[-1] if self.turns else None
        if isinstance(last, _Turn) and (has is None or getattr(last, has) is None):
            return last
        turn = _Turn()
        self.turns.append(turn)
        return turn

    def add(self, item: InputItem, i: int) -> None:
        where = f"input[{i}]"
        match item.type:
            case "message":
                refuse(item.role not in _ROLES, f"{where}: role must be one of {sorted(_ROLES)}, got "
                        f"{item.role!r}", f"{where}.role")
                if item.role == "user":
                    content, parts = _content(item.content, f"{where}.content", _IMAGE_PARTS, "text and images only")
                    self.turns.append(ChatMessage(role="user", content=content, parts=parts))
                    return
                text = _text(item.content, f"{where}.content", only=f"text only: images go in user messages, not "
                             f"{item.role} messages")
                if item.role == "assistant":
                    self._assistant("content").content = text
                else:
                    self.turns.append(ChatMessage(role=item.role or "", content=text))
            case "function_call":
                refuse(item.call_id is None, f"{where}: a function_call needs `call_id`", f"{where}.call_id")
                refuse(item.name is None, f"{where}: a function_call needs `name`", f"{where}.name")
                name = flat_name(item.namespace, item.name or "") if item.namespace else item.name or ""
                self._assistant().calls.append(ToolCall(id=item.call_id or "", name=name,
                                                        arguments=item.arguments or ""))
            case "function_call_output":
                refuse(item.call_id is None, f"{where}: a function_call_output needs `call_id`", f"{where}.call_id")
                content, parts = _content(item.output, f"{where}.output", _IMAGE_PARTS, "text and images only")
                self.turns.append(ChatMessage(role="tool", content=content, parts=parts, tool_call_id=item.call_id))
            case "reasoning":
                text = _text(item.content, f"{where}.content", ("reasoning_text", "text")) \
                    or _text(item.summary, f"{where}.summary", ("summary_text",))
                if text:  # one with no text (only encrypted_content) adds nothing
                    self._assistant("reasoning").reasoning = text
            case _:
                raise InvalidRequest(f"{where}: items of type {item.type!r} are not supported (messages, "
                                     "function_call, function_call_output and reasoning items only)",
                                     param=f"{where}.type")

    def messages(self) -> list[ChatMessage]:
        return [t if isinstance(t, ChatMessage) else
                ChatMessage(role="assistant", content=t.content or "", reasoning=t.reasoning, tool_calls=t.calls)
                for t in self.turns]


def _messages(b: ResponsesRequest, history: Sequence[ChatMessage] = ()) -> list[ChatMessage]:
    # This request's instructions first (a previous response's never carry over, as OpenAI's
    # rule is), then the conversation so far, then this input.
    out = [ChatMessage(role="system", content=b.instructions)] if b.instructions is not None else []
    out += history
    refuse(b.input is None, "input is required", "input")
    if isinstance(b.input, str):
        return [*out, ChatMessage(role="user", content=b.input)]
    refuse(not b.input, "input must not be empty", "input")
    chat = _Chat()
    for i, item in enumerate(b.input or ()):
        chat.add(item, i)
    return out + chat.messages()


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
    input without its own instructions, then its output as the assistant's turn (its reasoning,
    text and tool calls: the new input's ``function_call_output`` items answer those)."""
    messages = list(previous.messages or ())
    kept = previous.output.reported
    if kept is not None and kept.instructions is not None and messages and messages[0].role == "system" \
            and messages[0].content == kept.instructions:
        messages = messages[1:]
    choice = result.choices[0] if result.choices else None
    if choice is None:
        return [*messages, ChatMessage(role="assistant")]
    return [*messages, ChatMessage(role="assistant", content=choice.text, reasoning=choice.reasoning or None,
                                   tool_calls=list(choice.tool_calls or ()))]


def _reported(body: ResponsesRequest) -> Reported:
    """What the answers repeat and no worker uses, kept with the job."""
    fmt = body.text.format if body.text is not None else None
    reasoning = body.reasoning or ReasoningConfig()
    return Reported(instructions=body.instructions, metadata=body.metadata or {}, user=body.user,
                    format_name=fmt.name if fmt is not None and fmt.type == "json_schema" else None,
                    background=bool(body.background), store=body.store is not False,
                    previous_response_id=body.previous_response_id, tools=body.tools or None,
                    tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                    reasoning_effort=reasoning.effort,
                    reasoning_summary=reasoning.summary or reasoning.generate_summary)


def _chat_options(body: ResponsesRequest) -> ChatOptions:
    """``reasoning.effort`` for the template, as vLLM's Responses server passes it."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return ChatOptions()
    return ChatOptions(template_kwargs={"reasoning_effort": effort, "enable_thinking": effort != "none"})


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
    return GenerationRequest(model=body.model or "", messages=_messages(body, history), chat=_chat_options(body),
                             tools=_tools(body), sampling=sampling, dialect=NAME, cache_key=body.prompt_cache_key,
                             priority=priority_of_tier(body.service_tier),
                             output=OutputOptions(service_tier=body.service_tier, reported=_reported(body)))


def echo_of_body(body: ResponsesRequest, model: str) -> Echo:
    fmt = body.text.format if body.text is not None else None
    return Echo(
        model=model,
        background=bool(body.background),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        service_tier=tier_name(body.service_tier),
        store=body.store is not False,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        text_format=msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"},
        user=body.user,
        previous_response_id=body.previous_response_id,
        **echo_of_settings(_reported(body)),
    )


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
