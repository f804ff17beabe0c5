"""OpenAI ``POST /v1/chat/completions`` as vLLM's OpenAI server speaks it; also LMI's chat.

This module is the side coming in: the request and its translation (the worker renders
``messages`` with the model's own chat template). The answer is
:mod:`api.dialects.openai_chat_render`'s, a stream :mod:`api.dialects.openai_chat_stream`'s;
their names a route or the dialect registry needs are importable from here too. Errors have the
OpenAI shape of :mod:`api.dialects.openai_completions`.

Content parts: ``text``, and ``image_url`` (``{"url", "detail"}``, or the older bare URL string)
in ``user`` turns only; any other type, or an image in another role, is a 400. An image's URL must
be a ``data:`` URL or an http(s) URL, and its ``detail`` ``auto``, ``low`` or ``high``; nothing
more is checked here (admission, api/media.py, reads it). A turn's text parts are joined with
newlines, as vLLM joins them: a turn without an image is that text (``content``), as it always
was; a turn with one is its ``parts`` in order (``content`` empty), consecutive text parts joined
with newlines into one, each image in place between them.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from api.dialects.common import content_of, refuse, required, tool_use, url_image
from api.dialects.openai_chat_render import ChatCompletion, FunctionCall, MessageToolCall, render_result
from api.dialects.openai_chat_stream import ChatCompletionChunk, ChatStream, stream
from api.dialects.openai_completions import error_body
from api.dialects.openai_structured import ResponseFormat, StructuredOutputs, structured_output
from api.dialects.tiers import priority_of_tier, reported_tier
from api.dialects.vllm_extras import VllmExtras
from shared.errors import InvalidRequest
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    GenerationRequest,
    OutputOptions,
    Part,
    Text,
    Tool,
    ToolCall,
    ToolUse,
    ToolUseChoice,
)

__all__ = [
    "NAME",
    "ChatRequest",
    "to_generation_request",
    "render_result",
    "ChatStream",
    "stream",
    "error_body",
    "ChatCompletion",
    "ChatCompletionChunk",
    "FunctionCall",
    "MessageToolCall",
]

NAME: Final = "openai_chat"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
# apply_chat_template's own arguments: a template kwarg must not override how the worker renders.
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str | None = None
    """An http(s) URL, or a ``data:<media type>;base64,<data>`` URL."""
    detail: str | None = None
    """``auto``, ``low`` or ``high``."""


class ContentPart(msgspec.Struct, kw_only=True):
    """A ``text`` part, or an ``image_url`` part (``user`` turns only)."""

    type: str = "text"
    text: str | None = None
    image_url: ImageUrl | str | None = None
    """An ``image_url`` part's image: ``{"url", "detail"}``, or (the older form) the URL itself."""


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    """An assistant turn's reasoning, sent back (vLLM's field; ``reasoning_content`` was its old name)."""
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# The docstring is the schema's description in /openapi.json: the vLLM extras are VllmExtras's.
class ChatRequest(VllmExtras, kw_only=True):
    """OpenAI's fields plus vLLM's extras; unknown fields are accepted, as vLLM does. Single-field
    ranges are vLLM's (``SamplingParams._verify_args``); cross-field checks use vLLM's messages."""

    messages: list[Message]
    model: str | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    """Reaches the chat template as ``reasoning_effort`` (as in vLLM); a template without it ignores it."""
    include_reasoning: bool = True
    user: str | None = None
    prompt_cache_key: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    """OpenAI's: what the client's requests share; their jobs' prefix key (shared/affinity.py)."""
    structured_outputs: StructuredOutputs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int | None = None  # None: the X-LLMQ-Priority header, or 0
    service_tier: str | None = None  # a priority level (api/dialects/tiers.py); ``priority`` wins
    # vLLM fields llmq does not implement: refused when used (_UNSUPPORTED), never silently ignored
    echo: bool = False
    chat_template: str | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False


_UNSUPPORTED = (
    ("echo", "`echo` is not supported by this server"),
    ("chat_template", "a per-request `chat_template` is not supported; the model's own template is used"),
    ("prompt_logprobs", "`prompt_logprobs` is not supported for chat"),
    ("use_beam_search", "`use_beam_search` is not supported for chat"),
)


# --- translation ----------------------------------------------------------------------------


def _unsupported(b: ChatRequest) -> None:
    for name, message in _UNSUPPORTED:
        refuse(bool(getattr(b, name)), message, name)
    continuous = bool(b.stream_options and b.stream_options.continuous_usage_stats)
    refuse(continuous, "`stream_options.continuous_usage_stats` is not supported", "stream_options")


def _cross_checks(b: ChatRequest, temperature: float, max_tokens: int) -> None:
    """vLLM's request validators and ``SamplingParams`` checks that involve two fields."""
    n, so = 1 if b.n is None else b.n, b.stream_options
    refuse(so is not None and not b.stream, "Stream options can only be defined when `stream=True`.", "stream_options")
    top_only = bool(b.top_logprobs) and not b.logprobs
    refuse(top_only, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    refuse(
        b.continue_final_message and b.add_generation_prompt,
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
    )
    refuse(
        b.min_tokens > max_tokens,
        f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {b.min_tokens}.",
        "min_tokens",
    )
    refuse(n > 1 and temperature < GREEDY_EPS, f"n must be 1 when using greedy sampling, got {n}.", "n")


def _image(part: ContentPart, m: Message, where: str) -> Part:
    refuse(m.role != "user", f"{where}: `image_url` content parts are only supported in `user` messages, not "
           f"`{m.role}`", "messages")
    ref = part.image_url
    refuse(ref is None, f"{where}.image_url: Field required", "messages")
    if not isinstance(ref, ImageUrl):  # the older form: the URL itself
        return url_image(ref or "", url_at=f"{where}.image_url", param="messages")
    url = required(ref.url, f"{where}.image_url.url: Field required", "messages")
    return url_image(url, ref.detail, url_at=f"{where}.image_url.url", detail_at=f"{where}.image_url.detail",
                     param="messages")


def _content(m: Message, i: int) -> tuple[str, list[Part]]:
    """The turn's ``content`` and ``parts``: text parts joined with newlines, as vLLM does (the
    module's docstring)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or "", []
    parts: list[Part] = []
    for j, part in enumerate(m.content):
        if part.type == "image_url":
            parts.append(_image(part, m, f"messages[{i}].content[{j}]"))
            continue
        unsupported = f"messages[{i}]: content parts of type `{part.type}` are not supported (text and image_url only)"
        refuse(part.type != "text", unsupported, "messages")
        parts.append(Text(text=required(part.text, f"messages[{i}]: a `text` content part needs `text`", "messages")))
    return content_of(parts)


def _messages(b: ChatRequest) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(b.messages):
        calls = []
        for call in m.tool_calls or ():
            refuse(call.type != "function", f"messages[{i}]: tool calls of type `{call.type}` are not supported",
                   "messages")
            calls.append(ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments))
        content, parts = _content(m, i)
        out.append(ChatMessage(role=m.role, content=content, parts=parts, name=m.name, tool_calls=calls,
                               tool_call_id=m.tool_call_id,
                               reasoning=m.reasoning if m.reasoning is not None else m.reasoning_content))
    return out


def _tool_choice(b: ChatRequest) -> tuple[ToolUseChoice | None, str | None]:
    """The request's tool choice as :func:`tool_use` takes it, and the function a named one names."""
    if isinstance(b.tool_choice, NamedToolChoice):
        return "function", b.tool_choice.function.name
    return b.tool_choice, None


def _tools(b: ChatRequest) -> ToolUse | None:
    choice, function = _tool_choice(b)
    if b.tools is None:
        return tool_use(None, choice)
    tools = []
    for i, t in enumerate(b.tools):
        refuse(t.type != "function", f"tools[{i}]: tools of type `{t.type}` are not supported (function only)",
               "tools")
        f = t.function
        tools.append(Tool(name=f.name, description=f.description, parameters=f.parameters, strict=f.strict))
    return tool_use(tools, choice, function, parallel=b.parallel_tool_calls is not False)


def _template_kwargs(b: ChatRequest) -> dict[str, object]:
    kwargs = dict(b.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    refuse(bool(reserved), f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if b.reasoning_effort is not None:  # as vLLM passes it: the effort, and thinking unless it is "none"
        kwargs.setdefault("reasoning_effort", b.reasoning_effort)
        kwargs.setdefault("enable_thinking", b.reasoning_effort != "none")
    return kwargs


def to_generation_request(body: ChatRequest, *, max_model_len: int) -> GenerationRequest:
    """``max_tokens`` (or ``max_completion_tokens``) null means "up to the context", as in vLLM:
    the request asks for ``max_model_len - 1`` tokens and the engine stops at the context's end."""
    _unsupported(body)
    temperature = 1.0 if body.temperature is None else body.temperature
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = max_model_len - 1 if asked is None else asked
    _cross_checks(body, temperature, max_tokens)
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    refuse(any(not s for s in stop), "stop cannot contain an empty string.", "stop")
    try:
        logit_bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from None
    sampling = body.sampling_params(
        n=1 if body.n is None else body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=None if body.seed == -1 else body.seed,
        max_tokens=max_tokens,
        stop=stop,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logit_bias=logit_bias,
        structured=structured_output(body.structured_outputs, body.response_format),
    )
    chat = ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=_template_kwargs(body),
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return GenerationRequest(
        model=body.model or "",
        messages=_messages(body),
        chat=chat,
        tools=_tools(body),
        sampling=sampling,
        output=OutputOptions(include_usage=include_usage, service_tier=reported_tier(body.service_tier),
                             reasoning=body.include_reasoning),
        dialect=NAME,
        cache_key=body.prompt_cache_key,
        priority=body.priority if body.priority is not None else priority_of_tier(body.service_tier),
    )
