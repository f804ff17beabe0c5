"""Anthropic Messages: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as the anthropic
SDK (2.x) and Claude Code send them. This module translates requests; the message, the stream and
errors are rendered by :mod:`api.dialects.anthropic_render`.

A request is a chat: ``system`` becomes the first message (its text blocks joined with newlines,
as vLLM's own Anthropic endpoint does for text-only models, leaving out Claude Code's per-request
``x-anthropic-billing-header`` block as vLLM does), consecutive turns of one role are one turn (as
Anthropic combines them), and a conversation that ends with an ``assistant`` turn is continued
from that text (Anthropic's prefill). The worker renders it with the model's chat template, as
for OpenAI chat, with the tools.

Tool use maps to the OpenAI form every dialect shares (shared/schemas.py), as vLLM's Anthropic
server maps it (``vllm/entrypoints/anthropic/serving.py``):

- ``tools``: custom tools (``type`` absent or ``custom``) are the chat's functions;
  Anthropic-defined tools (a type with a date: ``web_search_20250305``, ``bash_20250124``,
  ``text_editor_*``, ``computer_*``, ...) run on Anthropic's side or need Anthropic's own schema,
  so they are left out (the model is not offered them) rather than failing the request.
- ``tool_choice``: ``auto``, ``any`` (vLLM's ``required``), ``tool`` (a named function), ``none``;
  ``disable_parallel_tool_use`` allows one call at most. With tools and no choice: ``auto``.
- History: an assistant turn's ``tool_use`` blocks are its ``tool_calls`` (``input`` as JSON
  text), its ``thinking`` blocks its ``reasoning`` (the signature is not checked), and
  ``redacted_thinking`` is dropped (llmq cannot read it). A user turn's ``tool_result`` blocks are
  ``tool`` turns (one per result, before the turn's text and images, which follow as a user turn);
  a result with ``is_error`` reaches the model as ``Error: <content>``.
- Images: ``image`` blocks (``source`` ``base64``, with ``media_type`` image/jpeg, image/png,
  image/gif or image/webp, or ``url``, an http(s) URL or a ``data:`` URL) in ``user`` turns, and in
  a ``tool_result``'s content (Claude Code's ``Read`` returns images there). Only their shape is
  checked here (admission, api/media.py, reads them); a ``file`` source (llmq has no files API) or
  an image anywhere else (``system``, an assistant turn) is a 400. Text blocks are joined with
  newlines, as before: a user turn or result without an image is that text (``content``), as it
  always was; with one it is its ``parts`` in order (``content`` empty), consecutive text blocks
  joined with newlines into one part, each image in place between them.
- ``thinking`` (``enabled``, ``adaptive``, ``disabled``) is the template's ``enable_thinking``
  (the Qwen3 convention) and ``output_config.effort`` its ``reasoning_effort``: what a template
  does with them is the template's affair. A thinking budget is checked as Anthropic checks it,
  and not enforced.

Accepted and without effect: ``cache_control`` anywhere (llmq has no prompt cache to steer),
``metadata``, ``context_management``, signatures, ``thinking.display``; unknown fields are ignored,
as newer SDKs send fields older servers do not know. Anything llmq cannot honour (documents, other
block types) is refused with Anthropic's ``invalid_request_error``, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from api.dialects.anthropic_render import (
    ErrorObject,
    ErrorResponse,
    Message,
    MessageStream,
    TokenCount,
    error_body,
    event,
    render_result,
    reported_tier,
    stop_of,
    stream,
)
from api.dialects.common import content_of, refuse, required, tool_use, url_image
from api.dialects.tiers import priority_of_tier
from shared.errors import InvalidRequest
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    GenerationRequest,
    Image,
    OutputOptions,
    Part,
    SamplingParams,
    StructuredOutput,
    Text,
    Tool,
    ToolCall,
    ToolUse,
    ToolUseChoice,
)

__all__ = [
    "NAME",
    "MessagesRequest",
    "CountTokensRequest",
    "to_generation_request",
    "chat_of",
    "render_result",
    "MessageStream",
    "stream",
    "stop_of",
    "error_body",
    "event",
    "reported_tier",
    "Message",
    "TokenCount",
    "ErrorObject",
    "ErrorResponse",
]

NAME: Final = "anthropic_messages"
ROLES = ("user", "assistant", "system")
BILLING_HEADER = "x-anthropic-billing-header"
"""How the system block Claude Code adds to every request begins: it changes per request (so it
would defeat any prefix cache) and says nothing to the model, so it is left out, as vLLM does."""
CHOICES: dict[str, ToolUseChoice] = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
THINKING = ("enabled", "disabled", "adaptive")
MIN_THINKING_BUDGET = 1024  # Anthropic's

# --- request ------------------------------------------------------------------------------------


MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
"""A ``base64`` image source's ``media_type``s (Anthropic's)."""


class ImageSource(msgspec.Struct, kw_only=True):
    """An ``image`` block's ``source``: ``base64`` (``media_type``, ``data``) or ``url``. Other
    blocks' sources (a document's) decode to it too, unread: their blocks are refused by type."""

    type: str | None = None
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ResultBlock(msgspec.Struct, kw_only=True):
    """A block of a ``tool_result``'s content; ``text`` and ``image`` are served."""

    type: str
    text: str | None = None
    source: ImageSource | str | None = None  # image; a search_result's is a string (refused by type)


class ContentBlock(msgspec.Struct, kw_only=True):
    """An input block: ``text``, ``tool_use``, ``tool_result``, ``thinking`` or
    ``redacted_thinking``, each with its own fields. Other fields (``cache_control``,
    ``citations``, ...) are accepted and have no effect."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking (its signature is accepted and not checked)
    source: ImageSource | str | None = None  # image; a search_result's is a string (refused by type)


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
    budget_tokens: int | None = None  # enabled's; Claude Code sends it with adaptive too (ignored)


class ToolDefinition(msgspec.Struct, kw_only=True):
    """A custom tool, or an Anthropic-defined one (``type`` with a date), which is left out."""

    name: str | None = None  # every custom tool has one; some Anthropic-defined ones (mcp_toolset) do not
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


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
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: Any = None  # accepted and ignored: llmq never edits the context


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]


# --- translation --------------------------------------------------------------------------------

Located = tuple[str, ContentBlock]
"""A block and where the request has it (``messages.2.content.1``), for error messages."""
_BLOCK_ROLE = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
               "tool_result": "user", "image": "user"}


def _text_blocks(content: str | list[ContentBlock], where: str) -> list[str]:
    """Content that may only be text (``system``): its texts."""
    if isinstance(content, str):
        return [content]
    texts = []
    for i, block in enumerate(content):
        refuse(block.type != "text", f"{where}.{i}: content blocks of type `{block.type}` are not supported "
                "by this server (text only)", where.split(".")[0])
        texts.append(required(block.text, f"{where}.{i}.text: Field required", where.split(".")[0]))
    return texts


def _system_text(texts: list[str]) -> str:
    """A system prompt: its texts joined with newlines, without Claude Code's billing header."""
    return "\n".join(t for t in texts if not t.startswith(BILLING_HEADER))


def _turns(b: CountTokensRequest) -> list[tuple[str, list[Located]]]:
    """The conversation's turns, consecutive messages of one role joined into one (as Anthropic
    combines them), each a role and its blocks (string content is one text block)."""
    turns: list[tuple[str, list[Located]]] = []
    for i, m in enumerate(b.messages):
        refuse(m.role not in ROLES, f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'",
               "messages")
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            blocks = [(where, ContentBlock(type="text", text=m.content))]
        else:
            blocks = [(f"{where}.{j}", block) for j, block in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    return turns


def _tool_call(block: ContentBlock, where: str) -> ToolCall:
    for field in ("id", "name", "input"):
        refuse(getattr(block, field) is None, f"{where}.{field}: Field required", "messages")
    return ToolCall(id=block.id or "", name=block.name or "", arguments=msgspec.json.encode(block.input).decode())


def _image(source: ImageSource | str | None, where: str) -> Image:
    """An ``image`` block's source (at ``where``), its shape checked: the module's docstring."""
    refuse(source is None, f"{where}.source: Field required", "messages")
    if not isinstance(source, ImageSource):
        raise InvalidRequest(f"{where}.source: Input should be an object", param="messages")
    refuse(source.type not in ("base64", "url"), f"{where}.source.type: Input should be 'base64' or 'url' "
           "(this server has no files API)", "messages")
    if source.type == "url":
        url = required(source.url, f"{where}.source.url: Field required", "messages")
        return url_image(url, url_at=f"{where}.source.url", param="messages")
    data = required(source.data, f"{where}.source.data: Field required", "messages")
    media_type = required(source.media_type, f"{where}.source.media_type: Field required", "messages")
    refuse(media_type not in MEDIA_TYPES, f"{where}.source.media_type: Input should be 'image/jpeg', 'image/png', "
           "'image/gif' or 'image/webp'", "messages")
    return Image(data=data, media_type=media_type)


def _tool_result(block: ContentBlock, where: str) -> ChatMessage:
    """One ``tool`` turn, its images in its parts; a failed call's content is marked ``Error: ``
    for the model, whose chat template has no other way to tell (OpenAI's form has no error flag)."""
    refuse(block.tool_use_id is None, f"{where}.tool_use_id: Field required", "messages")
    parts: list[Part] = []
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        found: list[Part] = []
        for k, part in enumerate(block.content):
            if part.type == "image":
                found.append(_image(part.source, f"{where}.content.{k}"))
                continue
            refuse(part.type != "text", f"{where}.content.{k}: content blocks of type `{part.type}` are not "
                   "supported in a tool_result by this server (text and image only)", "messages")
            found.append(Text(text=required(part.text, f"{where}.content.{k}.text: Field required", "messages")))
        text, parts = content_of(found)
    if block.is_error and parts:  # the mark goes before the first text, or is one of its own
        first = parts[0]
        parts = [Text(text=f"Error: {first.text}"), *parts[1:]] if isinstance(first, Text) else \
            [Text(text="Error"), *parts]
    elif block.is_error:
        text = f"Error: {text}" if text else "Error"
    return ChatMessage(role="tool", content=text, parts=parts, tool_call_id=block.tool_use_id)


def _turn(role: str, blocks: list[Located]) -> list[ChatMessage]:
    """One turn as chat messages. An assistant turn is one message (text, reasoning, calls); a
    user turn is its tool results, then its text (as vLLM orders them); a system turn is one
    system message in place, none when it says nothing."""
    parts: list[Part] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for where, block in blocks:
        if block.type == "text":
            refuse(block.text is None, f"{where}.text: Field required", "messages")
            parts.append(Text(text=block.text or ""))
            continue
        place = _BLOCK_ROLE.get(block.type)
        refuse(place is None, f"{where}: content blocks of type `{block.type}` are not supported by this server "
               "(text, image, tool use and thinking only)", "messages")
        refuse(place != role, f"{where}: `{block.type}` blocks can only be in `{place}` messages", "messages")
        if block.type == "image":
            parts.append(_image(block.source, where))
        elif block.type == "tool_use":
            calls.append(_tool_call(block, where))
        elif block.type == "tool_result":
            results.append(_tool_result(block, where))
        elif block.type == "thinking":
            refuse(block.thinking is None, f"{where}.thinking: Field required", "messages")
            reasoning.append(block.thinking or "")
        # redacted_thinking: accepted and dropped (its data is Anthropic's to read, not llmq's)
    texts = [p.text for p in parts if isinstance(p, Text)]  # system and assistant turns hold no image
    if role == "system":
        text = _system_text(texts)
        return [ChatMessage(role="system", content=text)] if text else []
    if role == "assistant":
        return [ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls,
                            reasoning="\n".join(reasoning) if reasoning else None)]
    if parts or not results:
        content, parts = content_of(parts)
        results.append(ChatMessage(role="user", content=content, parts=parts))
    return results


def _tools(b: CountTokensRequest) -> ToolUse | None:
    """The chat's tools: the custom ones (Anthropic-defined tools are left out), and the choice."""
    tools: list[Tool] | None = None
    hosted: set[str] = set()
    if b.tools is not None:
        tools = []
        for i, t in enumerate(b.tools):
            if t.type not in (None, "custom"):  # web_search_20250305, bash_20250124, ...: not ours to run
                hosted.add(t.name or "")
                continue
            refuse(t.name is None, f"tools.{i}.name: Field required", "tools")
            refuse(t.input_schema is None, f"tools.{i}.input_schema: Field required", "tools")
            tools.append(Tool(name=t.name or "", description=t.description, parameters=t.input_schema, strict=t.strict))
    c = b.tool_choice
    if c is None:
        return tool_use(tools, None)
    refuse(c.type not in CHOICES, "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    refuse(c.type == "tool" and not c.name, "tool_choice.name: Field required", "tool_choice")
    hosted -= {t.name for t in tools or ()}
    refuse(c.type == "tool" and c.name in hosted, f"tool_choice.name: `{c.name}` is an Anthropic-defined tool, "
           "which this server does not offer to the model", "tool_choice")
    return tool_use(tools, CHOICES[c.type], c.name, parallel=not c.disable_parallel_tool_use)


def _template_kwargs(b: CountTokensRequest) -> dict[str, object]:
    """``thinking`` as ``enable_thinking`` and ``output_config.effort`` as ``reasoning_effort``,
    the chat template's own arguments for them."""
    kwargs: dict[str, object] = {}
    if (t := b.thinking) is not None:
        refuse(t.type not in THINKING, "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'",
               "thinking")
        if t.type == "enabled":
            refuse(t.budget_tokens is None, "thinking.enabled.budget_tokens: Field required", "thinking")
            refuse((t.budget_tokens or 0) < MIN_THINKING_BUDGET, "thinking.enabled.budget_tokens: Input should be "
                   f"greater than or equal to {MIN_THINKING_BUDGET}", "thinking")
        kwargs["enable_thinking"] = t.type != "disabled"
    if b.output_config is not None and b.output_config.effort is not None:
        kwargs["reasoning_effort"] = b.output_config.effort
    return kwargs


def chat_of(b: CountTokensRequest) -> tuple[list[ChatMessage], ChatOptions, ToolUse | None]:
    """The conversation and its tools as the worker renders them: what ``count_tokens`` counts,
    exactly. A last ``assistant`` turn is continued rather than answered."""
    refuse(not b.messages, "messages: at least one message is required", "messages")
    tools = _tools(b)
    template_kwargs = _template_kwargs(b)
    out: list[ChatMessage] = []
    if b.system is not None and (system := _system_text(_text_blocks(b.system, "system"))):
        out.append(ChatMessage(role="system", content=system))
    turns = _turns(b)
    for role, blocks in turns:
        out += _turn(role, blocks)
    prefill = turns[-1][0] == "assistant"
    refuse(prefill and bool(out[-1].tool_calls), f"messages.{len(b.messages) - 1}: a final `assistant` turn "
           "with `tool_use` blocks cannot be continued: send their `tool_result` blocks in a `user` turn",
           "messages")
    chat = ChatOptions(add_generation_prompt=not prefill, continue_final_message=prefill,
                       template_kwargs=template_kwargs)
    return out, chat, tools


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
    messages, chat, tools = chat_of(body)
    budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
    refuse(budget is not None and budget >= body.max_tokens,
           "max_tokens: `max_tokens` must be greater than `thinking.budget_tokens`", "max_tokens")
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
    return GenerationRequest(model=body.model, messages=messages, chat=chat, tools=tools, sampling=sampling,
                             output=output, dialect=NAME, priority=_priority(body.service_tier))
