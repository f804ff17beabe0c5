"""OpenAI chat's stream: a job's events as ``chat.completion.chunk`` objects (the objects they
share with a whole answer are :mod:`api.dialects.openai_chat_render`'s).

Per choice, a first chunk with ``delta: {"role": "assistant", "content": ""}``, then content
deltas with ``finish_reason`` on the last one, a usage-only chunk (``choices: []``) when
``stream_options.include_usage``, and ``data: [DONE]`` last, also after an in-band error. LMI's
chat sends the same chunks as JSON lines without ``[DONE]`` (``sse_format=False``).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from api.dialects.openai_chat_render import ChoiceLogprobs, choice_logprobs, response_role, service_tier_of
from api.dialects.openai_completions import CompletionUsage, error_body, usage_body
from api.dialects.stream import JSONLINES, SSE, StreamRenderer
from shared.errors import ServiceError
from shared.events import Done, TokenDelta, Tokens
from shared.framing import KEEPALIVE_TICK, SSE_DONE, Keepalive, comment, jsonline, sse
from shared.schemas import GenerationRequest

__all__ = ["ChatCompletionChunk", "ChatStream", "stream"]


# Chunk objects, named after OpenAI's API reference; field order is the order on the wire, and a
# field that is sometimes absent is UnsetType (omitted), never None.


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


def _delta(d: TokenDelta, with_reasoning: bool) -> ChoiceDelta:
    """What a delta adds to the message (a delta that adds nothing makes no choice: _delta_choice)."""
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
        logprobs=choice_logprobs(d) if want_logprobs else None,
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
        self.want_logprobs = req.sampling.logprobs is not None
        self.role, self.tier = response_role(req), service_tier_of(req)
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

    def keepalive(self, tick: Keepalive = KEEPALIVE_TICK) -> list[bytes]:
        # SSE's comment (the queue standing included, as SseKeepalive's), unless JSON lines: no comment line there.
        return [comment(tick)] if self.sse_format else []

    def close(self) -> list[bytes]:
        return [SSE_DONE] if self.sse_format else []


def stream(req: GenerationRequest, job_id: str, created: int) -> ChatStream:
    return ChatStream(req, job_id, created)
