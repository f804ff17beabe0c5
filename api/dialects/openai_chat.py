"""OpenAI ``POST /v1/chat/completions`` as vLLM's OpenAI server speaks it; also LMI's chat.

The worker renders ``messages`` with the model's own chat template. A stream is, per choice, a
first chunk with ``delta: {"role": "assistant", "content": ""}``, then content deltas with
``finish_reason`` on the last one, a usage-only chunk (``choices: []``) when
``stream_options.include_usage``, and ``data: [DONE]`` last, also after an in-band error.
LMI's chat sends the same chunks as JSON lines without ``[DONE]`` (``sse_format=False``).
Errors have the OpenAI shape of :mod:`api.dialects.openai_completions`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects.common import refuse, tool_use
from api.dialects.openai_completions import CompletionUsage, error_body, usage_body
from api.dialects.openai_structured import ResponseFormat, StructuredOutputs, structured_output
from api.dialects.stream import JSONLINES, SSE, StreamRenderer
from api.dialects.tiers import priority_of_tier, reported_tier
from shared.errors import InvalidRequest, ServiceError
from shared.events import LOGPROB_FLOOR, Done, TokenDelta, Tokens
from shared.framing import KEEPALIVE, SSE_DONE, jsonline, sse
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    Choice,
    GenerationRequest,
    JobResult,
    OutputOptions,
    SamplingParams,
    Tool,
    ToolCall,
    ToolUse,
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
]

NAME: Final = "openai_chat"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
# apply_chat_template's own arguments: a template kwarg must not override how the worker renders.
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


class ContentPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = ""


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant turn: sent back in history, and rendered in a result."""

    id: str
    type: str = "function"
    function: FunctionCall


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


class ChatRequest(msgspec.Struct, kw_only=True):
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
    # vLLM extras
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
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


def _content(m: Message, i: int) -> str:
    """Text parts are joined with newlines, as vLLM does for text-only models."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for part in m.content:
        unsupported = f"messages[{i}]: content parts of type `{part.type}` are not supported (text only)"
        refuse(part.type != "text", unsupported, "messages")
        refuse(part.text is None, f"messages[{i}]: a `text` content part needs `text`", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def _messages(b: ChatRequest) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(b.messages):
        calls = []
        for call in m.tool_calls or ():
            refuse(call.type != "function", f"messages[{i}]: tool calls of type `{call.type}` are not supported",
                   "messages")
            calls.append(ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments))
        out.append(ChatMessage(role=m.role, content=_content(m, i), name=m.name, tool_calls=calls,
                               tool_call_id=m.tool_call_id,
                               reasoning=m.reasoning if m.reasoning is not None else m.reasoning_content))
    return out


def _tools(b: ChatRequest) -> ToolUse | None:
    if b.tools is None:
        return tool_use(None, "function" if isinstance(b.tool_choice, NamedToolChoice) else b.tool_choice)
    tools = []
    for i, t in enumerate(b.tools):
        refuse(t.type != "function", f"tools[{i}]: tools of type `{t.type}` are not supported (function only)",
               "tools")
        f = t.function
        tools.append(Tool(name=f.name, description=f.description, parameters=f.parameters, strict=f.strict))
    named = b.tool_choice if isinstance(b.tool_choice, NamedToolChoice) else None
    return tool_use(tools, "function" if named is not None else b.tool_choice,
                    named.function.name if named is not None else None,
                    parallel=b.parallel_tool_calls is not False)


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
    sampling = SamplingParams(
        n=1 if body.n is None else body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=None if body.seed == -1 else body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=body.stop_token_ids or [],
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
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


# --- rendering ------------------------------------------------------------------------------


def response_role(req: GenerationRequest) -> str:
    """vLLM answers as the assistant, or, without a generation prompt, as the last message's role."""
    if req.chat.add_generation_prompt or not req.messages:
        return "assistant"
    return req.messages[-1].role


# Response objects, named after OpenAI's API reference; field order is the order on the wire. A
# field that is sometimes absent is UnsetType (omitted), never None (an explicit null).


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatCompletionTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatCompletionTokenLogprob]


class ChatCompletionMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    """None (null) when the model only called tools, as in vLLM."""
    reasoning: str | UnsetType = UNSET  # vLLM 0.32's field, with a reasoning parser
    tool_calls: list[MessageToolCall] | UnsetType = UNSET


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: str | int | None  # vLLM's extra: the stop string or token id that ended the choice


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    service_tier: str | UnsetType = UNSET  # only when the request named one


class ChoiceDeltaFunction(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # only in a call's first piece
    arguments: str


class ChoiceDeltaToolCall(msgspec.Struct, kw_only=True):
    """A piece of a call: the first carries ``id``, ``type`` and the name, later ones arguments."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: ChoiceDeltaFunction


class ChoiceDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET  # only in a choice's opening chunk
    content: str | UnsetType = UNSET  # absent from a chunk that carries only reasoning or tool calls
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ChoiceDeltaToolCall] | UnsetType = UNSET


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None | UnsetType = UNSET  # vLLM sends it with finish_reason only


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One chunk of a stream; the usage-only chunk has empty ``choices``, and only it has ``usage``."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    service_tier: str | UnsetType = UNSET  # only when the request named one
    choices: list[ChunkChoice]
    usage: CompletionUsage | UnsetType = UNSET


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


def _logprobs(src: Choice | TokenDelta) -> ChoiceLogprobs:
    content, tops = [], src.top_logprobs or []
    for i, (text, logprob) in enumerate(zip(src.token_texts or [], src.logprobs or [], strict=False)):
        top = tops[i] if i < len(tops) else []
        content.append(ChatCompletionTokenLogprob(
            token=text, logprob=max(logprob, LOGPROB_FLOOR), bytes=_utf8(text),
            top_logprobs=[TopLogprob(token=t.text, logprob=max(t.logprob, LOGPROB_FLOOR), bytes=_utf8(t.text))
                          for t in top],
        ))
    return ChoiceLogprobs(content=content)


def _message(c: Choice, role: str, with_reasoning: bool) -> ChatCompletionMessage:
    calls = [MessageToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
             for t in c.tool_calls or ()]
    return ChatCompletionMessage(
        role=role, content=c.text if c.text or not calls else None,
        reasoning=c.reasoning if c.reasoning is not None and with_reasoning else UNSET,
        tool_calls=calls or UNSET,
    )


def _choice(c: Choice, role: str, want_logprobs: bool, with_reasoning: bool = True) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=c.index,
        message=_message(c, role, with_reasoning),
        logprobs=_logprobs(c) if want_logprobs else None,
        finish_reason=c.finish_reason or "stop",
        stop_reason=c.stop_reason,
    )


def _tier(req: GenerationRequest) -> str | UnsetType:
    return UNSET if req.output.service_tier is None else req.output.service_tier


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> ChatCompletion:
    role, want_logprobs = response_role(req), req.sampling.logprobs is not None
    return ChatCompletion(
        id=f"chatcmpl-{job_id}",
        created=created,
        model=req.served_name,
        choices=[_choice(c, role, want_logprobs, req.output.reasoning) for c in result.choices],
        usage=usage_body(result.usage),
        service_tier=_tier(req),
    )


def _delta(d: TokenDelta, with_reasoning: bool) -> ChoiceDelta | None:
    """What a delta adds to the message (None: nothing, a parser holding text back)."""
    reasoning = d.reasoning if with_reasoning else ""
    if not (reasoning or d.tool_calls):
        return ChoiceDelta(content=d.text)
    calls = [ChoiceDeltaToolCall(index=t.index, id=UNSET if t.id is None else t.id,
                                 type=UNSET if t.id is None else "function",
                                 function=ChoiceDeltaFunction(name=UNSET if t.name is None else t.name,
                                                              arguments=t.arguments))
             for t in d.tool_calls]
    return ChoiceDelta(content=d.text or UNSET, reasoning=reasoning or UNSET, tool_calls=calls or UNSET)


def _delta_choice(d: TokenDelta, want_logprobs: bool, with_reasoning: bool = True,
                  parsed: bool = False) -> ChunkChoice | None:
    """``parsed``: the chat has tools, whose parser holds text back (tokens with no text then send
    nothing, as in vLLM, unless their logprobs are asked for)."""
    held = parsed and not want_logprobs
    if not (d.text or d.reasoning or d.tool_calls or d.finish_reason is not None or (d.token_ids and not held)):
        return None  # nothing new (vLLM skips these too)
    return ChunkChoice(
        index=d.index,
        delta=_delta(d, with_reasoning),
        logprobs=_logprobs(d) if want_logprobs else None,
        finish_reason=d.finish_reason,
        stop_reason=UNSET if d.finish_reason is None else d.stop_reason,
    )


class ChatStream(StreamRenderer[bytes]):
    """SSE chunks ending with ``[DONE]`` (also after an error: the openai SDK waits for it); with
    ``sse_format=False`` (LMI's default for chat) the same chunks as JSON lines, no keep-alives
    and no terminator."""

    def __init__(self, req: GenerationRequest, job_id: str, created: int, *, sse_format: bool = True) -> None:
        self.req, self.job_id, self.created = req, job_id, created
        self.sse_format = sse_format
        self.frame = sse if sse_format else jsonline
        self.media_type = SSE if sse_format else JSONLINES
        self.want_logprobs, self.role, self.tier = req.sampling.logprobs is not None, response_role(req), _tier(req)
        self.model = req.served_name  # read once, not per chunk
        self.started = False

    def _chunk(self, choices: list[ChunkChoice], usage: CompletionUsage | UnsetType = UNSET) -> bytes:
        return self.frame(ChatCompletionChunk(id=f"chatcmpl-{self.job_id}", created=self.created,
                                              model=self.model, service_tier=self.tier, choices=choices,
                                              usage=usage))

    def step(self, event: Tokens | Done) -> list[bytes]:
        out = []
        if not self.started:  # like vLLM: every choice opens with its role, before any content
            self.started = True
            for index in range(self.req.sampling.n):
                opening = ChoiceDelta(role=self.role, content="")
                out.append(self._chunk([ChunkChoice(index=index, delta=opening, logprobs=None, finish_reason=None)]))
        for delta in event.deltas:
            choice = _delta_choice(delta, self.want_logprobs, self.req.output.reasoning, self.req.tools is not None)
            if choice is not None:
                out.append(self._chunk([choice]))
        if isinstance(event, Done) and self.req.output.include_usage:
            out.append(self._chunk([], usage_body(event.usage)))
        return out

    def fail(self, exc: ServiceError) -> list[bytes]:
        return [self.frame(error_body(exc)[1])]

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE] if self.sse_format else []  # JSON lines has no comment line

    def close(self) -> list[bytes]:
        return [SSE_DONE] if self.sse_format else []


def stream(req: GenerationRequest, job_id: str, created: int) -> ChatStream:
    return ChatStream(req, job_id, created)
