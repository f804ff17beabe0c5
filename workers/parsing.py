"""A chat's output parsed into content, reasoning and tool calls, by vLLM's own parsers.

The worker runs the parsers vLLM's OpenAI server runs (``--tool-call-parser``, ``--reasoning-parser``;
here ``LLMQ_TOOL_PARSER`` and ``LLMQ_REASONING_PARSER``), on the worker, because they need vLLM,
the tokenizer and the token ids, and the API never imports vLLM. Each engine step's delta is fed
to a per-choice parser (:class:`ChoiceParser`); the event then carries the content as ``text``
and the reasoning and tool-call pieces apart, and every dialect renders those.

- **Constraints**, as vLLM sets them (``Parser.adjust_request``): ``required`` and a named tool
  are enforced by structured outputs built from the tools' schemas (the parser's own format as
  an xgrammar structural tag, or, for a model without a tool parser, a JSON schema that vLLM's
  streaming code reads back); strict tools constrain ``auto`` too.
- **Ids** of tool calls are derived from the job and the call's position, not vLLM's random
  ones, so a continued or replayed job gives the same ids (workers/continuation.py).
- **Finish reason** ``tool_calls`` when a choice called tools and the choice was not a named
  tool, as vLLM's server reports it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import DelegatingParser, Parser
from vllm.parser.parser_manager import ParserManager
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from shared.chat_template import openai_tools
from shared.errors import InvalidRequest
from shared.events import TokenDelta, ToolCallDelta
from shared.schemas import ChatMessage, GenerationRequest, ToolUse

__all__ = ["OutputParsers", "Parsing", "ChoiceParser", "tool_call_id"]


def tool_call_id(job_id: str, choice: int, call: int) -> str:
    """A call's id: the same for every attempt at the job (a continuation replays the same calls)."""
    return f"call_{job_id}_{call}" if choice == 0 else f"call_{job_id}_{choice}_{call}"


class _ForcedOnly(ToolParser):
    """The tool parser of a model without one: only ``required`` and named choices reach it (the
    API refuses ``auto``), and vLLM constrains those to JSON (``ToolParser.adjust_request``) and
    reads them back with its own streaming code (``DelegatingParser``); text is content."""

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     *args: Any, **kwargs: Any) -> DeltaMessage | None:
        return DeltaMessage(content=delta_text) if delta_text else None


class OutputParsers:
    """The worker's parsers, chosen by its settings, and a :class:`Parsing` per chat request."""

    def __init__(self, tokenizer: Any, *, tool_parser: str | None, reasoning_parser: str | None,
                 strict_level: str = "auto", compact_json: bool = False) -> None:
        self.tokenizer = tokenizer
        self.compact_json = compact_json
        # A bad name, or a tokenizer without the tokens a parser needs, fails the worker at start.
        reasoning_cls = ParserManager.get_reasoning_parser(reasoning_parser)
        if tool_parser:
            self.with_tools = ParserManager.get_parser(tool_parser_name=tool_parser,
                                                       reasoning_parser_name=reasoning_parser,
                                                       enable_auto_tools=True, tool_strict_level=strict_level,
                                                       tokenizer=tokenizer)
        else:
            self.with_tools = type("ForcedToolParser", (DelegatingParser,),
                                   {"reasoning_parser_cls": reasoning_cls, "tool_parser_cls": _ForcedOnly})
        self.without_tools = ParserManager.get_parser(reasoning_parser_name=reasoning_parser, tokenizer=tokenizer)

    def parses(self, req: GenerationRequest) -> bool:
        """Whether ``req``'s output goes through a parser: a chat with tools, or any chat when the
        model has a reasoning parser."""
        return req.messages is not None and (req.tools is not None or self.without_tools is not None)

    def plan(self, req: GenerationRequest) -> Parsing | None:
        if not self.parses(req):
            return None
        parser_cls = self.with_tools if req.tools is not None and req.tools.tools else self.without_tools
        if parser_cls is None:  # tools: [] without a reasoning parser: nothing to parse
            return None
        request = _vllm_request(req)
        # adjust_request constrains the output (structured outputs) the way vLLM's server does.
        request = parser_cls(self.tokenizer, request.tools).adjust_request(request)
        so = request.structured_outputs
        if self.compact_json and so is not None and so.structural_tag is not None:
            request.structured_outputs = replace(so, structural_tag=_compact(so.structural_tag))
        return Parsing(request=request, parser_cls=parser_cls, tokenizer=self.tokenizer,
                       named=req.tools is not None and req.tools.choice == "function")


def _compact(structural_tag: str) -> str:
    """The structural tag with at most one whitespace character where its JSON allows any
    (LLMQ_COMPACT_JSON, which vLLM applies to JSON schemas but not to the JSON inside a structural
    tag; xgrammar takes no 0 here): a model that favours whitespace, as the tiny one does, would
    otherwise pad a call's arguments until max_tokens."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: walk(v) for k, v in node.items()}
            if node.get("type") == "json_schema":
                node["max_whitespace_cnt"] = 1
            return node
        return [walk(v) for v in node] if isinstance(node, list) else node

    return json.dumps(walk(json.loads(structural_tag)))


def _vllm_request(req: GenerationRequest) -> ChatCompletionRequest:
    """``req`` as vLLM's own ``ChatCompletionRequest``: what its parsers read (tools, choice,
    parallel calls, whether reasoning is returned)."""
    tools = req.tools or ToolUse()
    body: dict[str, Any] = {
        "model": req.model or "model",
        "messages": [_openai_message(m) for m in req.messages or ()],
        "include_reasoning": True,
        "skip_special_tokens": req.sampling.skip_special_tokens,
    }
    so = req.sampling.structured
    if so is not None:  # so that vLLM combines it with the tools' constraint (auto: either one), or drops it (forced)
        body["structured_outputs"] = {k: v for k, v in msgspec.structs.asdict(so).items() if v not in (None, False)}
    if tools.tools:
        body["tools"] = openai_tools(tools)
        body["tool_choice"] = ({"type": "function", "function": {"name": tools.function}}
                               if tools.choice == "function" else tools.choice)
        body["parallel_tool_calls"] = tools.parallel
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as exc:  # vLLM's own validators (a named tool that is not offered, ...)
        raise InvalidRequest(f"invalid tools: {exc}") from None


def _openai_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


@dataclass(slots=True)
class Parsing:
    """One chat request's parsing: the constraint it adds, and a parser per choice."""

    request: ChatCompletionRequest
    parser_cls: type[Parser]
    tokenizer: Any
    named: bool

    def constrain(self, params: VllmSamplingParams) -> None:
        """What ``adjust_request`` changed: the tools' constraint (it replaces the request's own
        structured output, as in vLLM), and special tokens kept where a parser reads them."""
        if self.request.structured_outputs is not None:
            params.structured_outputs = self.request.structured_outputs
        params.skip_special_tokens = self.request.skip_special_tokens

    def reasoning_ended(self, prompt_ids: list[int]) -> bool | None:
        """The engine's ``reasoning_ended``: a grammar applies only after the reasoning, and the
        engine must know whether the prompt already ended it."""
        return self.request.resolve_reasoning_ended(self.parser_cls(self.tokenizer, self.request.tools), prompt_ids)

    def choice(self, job_id: str, index: int) -> ChoiceParser:
        return ChoiceParser(self, self.parser_cls(self.tokenizer, self.request.tools), job_id, index)


class ChoiceParser:
    """One choice's parser, fed its deltas in order (also the forced replay of a continued job:
    a fresh parser must see every token from the first)."""

    def __init__(self, parsing: Parsing, parser: Parser, job_id: str, index: int) -> None:
        self.parsing, self.parser = parsing, parser
        self.job_id, self.index = job_id, index
        self.called = False

    def feed(self, delta: TokenDelta, prompt_ids: Sequence[int] | None) -> None:
        """Rewrite ``delta`` in place: ``text`` becomes the content it completes, and its reasoning
        and tool-call pieces come apart."""
        finished = delta.finish_reason is not None
        message = self.parser.parse_delta(delta.text, list(delta.token_ids), self.parsing.request,
                                          list(prompt_ids) if prompt_ids is not None else None, finished=finished)
        delta.text = (message.content or "") if message is not None else ""
        delta.reasoning = (message.reasoning or "") if message is not None else ""
        delta.tool_calls = self._calls(message) if message is not None else []
        if delta.finish_reason == "stop" and self.called and not self.parsing.named:
            delta.finish_reason = "tool_calls"

    def _calls(self, message: DeltaMessage) -> list[ToolCallDelta]:
        """The message's tool-call pieces, one per call (vLLM's parsers may send a call's name and
        its first arguments as two pieces of one message)."""
        calls: list[ToolCallDelta] = []
        for piece in message.tool_calls:
            function = piece.function
            arguments = (function.arguments or "") if function is not None else ""
            if calls and calls[-1].index == piece.index and piece.id is None:
                calls[-1].arguments += arguments
                continue
            call = ToolCallDelta(index=piece.index, arguments=arguments)
            if piece.id is not None:
                self.called = True
                call.id = tool_call_id(self.job_id, self.index, piece.index)
                call.name = function.name if function is not None else None
            calls.append(call)
        return calls
