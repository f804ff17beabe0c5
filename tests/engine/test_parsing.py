"""A chat's output parsed by vLLM's own parsers on the worker (workers/parsing.py), fed scripted
text through the tiny model's tokenizer: the events, the deterministic ids, the finish reason,
chunking, and a continued job's replay dropping exactly what the client already holds."""

from __future__ import annotations

import copy

import msgspec
import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from transformers import AutoTokenizer

from shared.config import load_settings
from shared.errors import WorkerLost
from shared.events import TokenDelta, Tokens
from shared.result import ResultBuilder
from shared.schemas import ChatMessage, GenerationRequest, SamplingParams, StructuredOutput, Tool, ToolUse
from workers.continuation import Replay, published
from workers.parsing import OutputParsers
from workers.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

WEATHER = Tool(name="get_weather", description="w", strict=True,
               parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    settings = load_settings()
    return AutoTokenizer.from_pretrained(ensure_tiny_model(settings.model_path))


def chat(choice: str = "auto", function: str | None = None) -> GenerationRequest:
    return GenerationRequest(messages=[ChatMessage(role="user", content="weather?")], sampling=SamplingParams(),
                             tools=ToolUse(tools=[WEATHER], choice=choice, function=function))


def deltas(tokenizer, text: str, per: int) -> list[TokenDelta]:
    """``text`` as the engine would hand it over, ``per`` tokens a step, the last one finished."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for i in range(0, len(ids), per):
        chunk = ids[i:i + per]
        out.append(TokenDelta(token_ids=chunk, text=tokenizer.decode(chunk)))
    out[-1].finish_reason = "stop"
    return out


def parse(parsers: OutputParsers, req: GenerationRequest, steps: list[TokenDelta]) -> list[TokenDelta]:
    parser = parsers.plan(req).choice("job9", 0)
    for delta in steps:
        parser.feed(delta, [1, 2, 3])
    return steps


def folded(steps: list[TokenDelta]):
    builder = ResultBuilder()
    builder.add(Tokens(seq=1, deltas=steps))
    return builder.result().choices[0]


@pytest.mark.parametrize("per", [1, 3, 1000])
def test_auto_parses_content_and_a_call_with_the_jobs_id_whatever_the_chunking(tokenizer, per):
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    steps = parse(parsers, chat(), deltas(tokenizer, TEXT, per))
    choice = folded(steps)
    assert choice.text == "Let me check."
    assert [(c.id, c.name, c.arguments) for c in choice.tool_calls] == [("call_job9_0", "get_weather",
                                                                         '{"city": "Paris"}')]
    assert choice.finish_reason == "tool_calls"
    opening = [c for d in steps for c in d.tool_calls if c.id is not None]
    assert len(opening) == 1, "a call is named once, in its first piece"


def test_a_named_choice_finishes_with_stop_as_vllm_reports_it(tokenizer):
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    choice = folded(parse(parsers, chat("function", "get_weather"), deltas(tokenizer, TEXT, 2)))
    assert choice.tool_calls[0].arguments == '{"city": "Paris"}' and choice.finish_reason == "stop"


def test_forced_choices_are_constrained_and_auto_with_a_strict_tool_too(tokenizer):
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    for req in (chat("required"), chat("function", "get_weather"), chat("auto")):
        tag = parsers.plan(req).request.structured_outputs.structural_tag
        assert "get_weather" in tag and '"city"' in tag, "the call's envelope and its schema"
    loose = GenerationRequest(messages=[ChatMessage(role="user", content="x")],
                              tools=ToolUse(tools=[Tool(name="f")], choice="auto"))
    assert parsers.plan(loose).request.structured_outputs is None, "auto with no strict tool is free text"


def test_without_a_tool_parser_a_forced_choice_is_json_read_back_by_vllm(tokenizer):
    parsers = OutputParsers(tokenizer, tool_parser=None, reasoning_parser=None)
    plan = parsers.plan(chat("function", "get_weather"))
    assert plan.request.structured_outputs.json == WEATHER.parameters
    choice = folded(parse(parsers, chat("function", "get_weather"), deltas(tokenizer, '{"city": "Rome"}', 2)))
    assert [(c.id, c.name, c.arguments) for c in choice.tool_calls] == [("call_job9_0", "get_weather",
                                                                         '{"city": "Rome"}')]
    required = parsers.plan(chat("required"))
    assert required.request.structured_outputs.json["type"] == "array"


def test_plain_chats_and_prompts_are_not_parsed_without_a_reasoning_parser(tokenizer):
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    assert parsers.plan(GenerationRequest(messages=[ChatMessage(role="user", content="x")])) is None
    assert parsers.plan(GenerationRequest(prompt="x")) is None


@pytest.mark.parametrize("fraction", [0.1, 0.4, 0.7, 0.9])
def test_a_replay_through_a_fresh_parser_sends_only_what_the_client_lacks(tokenizer, fraction):
    """A worker dies after ``cut`` steps; its successor replays every token through a new parser,
    in other chunks: the client's stream, joined, equals an uninterrupted run's."""
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    whole = parse(parsers, chat(), deltas(tokenizer, TEXT, 1))
    sent = copy.deepcopy(whole[:int(len(whole) * fraction)])
    held = published([Tokens(seq=1, deltas=sent)])[0]
    replay = Replay(held)
    rest = [d for d in (replay.trim(d) for d in parse(parsers, chat(), deltas(tokenizer, TEXT, 3))) if d is not None]
    assert folded(sent + rest) == folded(whole)
    assert sum(c.id is not None for d in sent + rest for c in d.tool_calls) == 1, "the call is named once"


def test_a_replay_that_does_not_reproduce_the_sent_arguments_fails_the_job(tokenizer):
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    held = published([Tokens(seq=1, deltas=parse(parsers, chat(), deltas(tokenizer, TEXT, 1))[:-3])])[0]
    assert held.calls[0], "the cut falls inside the arguments"
    held.calls[0] = held.calls[0][:-1] + "#"  # what the client holds differs from what the replay makes
    replay = Replay(held)
    with pytest.raises(WorkerLost):
        for d in parse(parsers, chat(), deltas(tokenizer, TEXT, 1)):
            replay.trim(d)


def test_a_requests_own_json_schema_is_kept_beside_auto_tools_and_dropped_by_a_forced_one(tokenizer):
    """An agent's typed answer (text.format / response_format) with tools under auto: the model may
    call a tool or write the answer's JSON, as vLLM combines them; a forced choice wins alone."""
    parsers = OutputParsers(tokenizer, tool_parser="hermes", reasoning_parser=None)
    answer = {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy"]}}, "required": ["sky"]}
    typed = SamplingParams(structured=StructuredOutput(json=answer))
    auto = msgspec.structs.replace(chat(), sampling=typed)
    tag = parsers.plan(auto).request.structured_outputs.structural_tag
    assert '"sunny"' in tag and 'get_weather' in tag, "either a call or the answer's JSON"
    forced = msgspec.structs.replace(chat("required"), sampling=typed)
    tag = parsers.plan(forced).request.structured_outputs.structural_tag
    assert 'get_weather' in tag and '"sunny"' not in tag, "a forced call replaces the answer's format"
