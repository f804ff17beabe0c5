"""OpenAI chat's side of the wire going out: the ``chat.completion`` object and how a job's result
becomes one (:mod:`api.dialects.openai_chat` is the side coming in: the request and its
translation; :mod:`api.dialects.openai_chat_stream` the chunks of a stream).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.openai_completions import CompletionUsage, usage_body
from shared.events import LOGPROB_FLOOR, TokenDelta
from shared.schemas import Choice, GenerationRequest, JobResult

__all__ = [
    "FunctionCall",
    "MessageToolCall",
    "ChatCompletion",
    "ChatCompletionMessage",
    "ChoiceLogprobs",
    "response_role",
    "choice_logprobs",
    "service_tier_of",
    "render_result",
]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = ""


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant turn: sent back in history, and rendered in a result."""

    id: str
    type: str = "function"
    function: FunctionCall


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


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


def choice_logprobs(src: Choice | TokenDelta) -> ChoiceLogprobs:
    """A choice's (or a delta's) token logprobs, none below LOGPROB_FLOOR."""
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
        logprobs=choice_logprobs(c) if want_logprobs else None,
        finish_reason=c.finish_reason or "stop",
        stop_reason=c.stop_reason,
    )


def service_tier_of(req: GenerationRequest) -> str | UnsetType:
    """The tier an answer reports: only the one the request named (else the key is omitted)."""
    return UNSET if req.output.service_tier is None else req.output.service_tier


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> ChatCompletion:
    role, want_logprobs = response_role(req), req.sampling.logprobs is not None
    return ChatCompletion(
        id=f"chatcmpl-{job_id}",
        created=created,
        model=req.served_name,
        choices=[_choice(c, role, want_logprobs, req.output.reasoning) for c in result.choices],
        usage=usage_body(result.usage),
        service_tier=service_tier_of(req),
    )
