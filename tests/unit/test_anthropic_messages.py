"""Anthropic Messages: translation of every field, every refusal, the service-tier mapping, and
the exact bytes of the message, each stream event and each error."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from api.dialects import anthropic_messages as am
from api.dialects.anthropic_render import signature, tool_use_id
from api.dialects.tiers import priority_of_tier
from api.submit import check_queueable
from shared import json_input
from shared.codec import decode_request, encode
from shared.errors import (
    DeadlineExceeded,
    GenerationFailed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    QueueUnavailable,
    ServiceError,
    Unauthorized,
)
from shared.events import Done, Error, TokenDelta, Tokens, ToolCallDelta
from shared.framing import KEEPALIVE, Keepalive
from shared.queue import level_of
from shared.result import ResultBuilder
from shared.schemas import ChatMessage, Choice, JobResult, StructuredOutput, Tool, ToolCall, ToolUse, Usage
from tests.support.dialect_bodies import anthropic_bodies
from tests.support.streams import frames as rendered

HI = [{"role": "user", "content": "hi"}]


def body(**fields) -> am.MessagesRequest:
    return msgspec.convert({"model": "claude", "max_tokens": 8, "messages": HI, **fields}, am.MessagesRequest)


def req(**fields):
    return am.to_generation_request(body(**fields))


def refused(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        req(**fields)
    return info.value


async def frames(r, events, **kw) -> list[bytes]:
    return await rendered(am.MessageStream(r, "j1", **kw), events)


# --- translation ----------------------------------------------------------------------------------


def test_defaults():
    r = req()
    s = r.sampling
    assert r.messages == [ChatMessage(role="user", content="hi")] and r.prompt is None
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.structured) == (1.0, 1.0, 0, 8, [], None)
    assert r.chat.add_generation_prompt and not r.chat.continue_final_message
    assert (r.model, r.dialect, r.priority) == ("claude", "anthropic_messages", None)


def test_every_field_is_mapped():
    r = req(temperature=0.2, top_p=0.5, top_k=40, stop_sequences=["\n\nHuman:", "END"],
            metadata={"user_id": "user-7f3a"}, stream=True, service_tier="priority")
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop) == (0.2, 0.5, 40, ["\n\nHuman:", "END"])
    assert r.priority == -1
    assert b"user-7f3a" not in encode(r)  # metadata.user_id goes nowhere


def test_system_and_text_blocks_and_turns():
    blocks = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": blocks}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    r = req(system=[{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}], messages=messages)
    assert r.messages == [ChatMessage(role="system", content="s1\ns2"), ChatMessage(role="user", content="a\nb\nc"),
                          ChatMessage(role="assistant", content="d"), ChatMessage(role="user", content="e")]
    assert req(system="sys").messages[0] == ChatMessage(role="system", content="sys")
    assert req(system="").messages == [ChatMessage(role="user", content="hi")]  # an empty system is no turn


def test_a_last_assistant_turn_is_continued():
    r = req(messages=[*HI, {"role": "assistant", "content": "The answer is ("}])
    assert r.messages[-1] == ChatMessage(role="assistant", content="The answer is (")
    assert not r.chat.add_generation_prompt and r.chat.continue_final_message


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = req(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.sampling.structured == StructuredOutput(json=schema)
    assert req(output_config={}).sampling.structured is None


@pytest.mark.parametrize("tier,priority", [(None, None), ("auto", None), ("standard_only", None),
                                           ("default", None), ("priority", -1), ("flex", 2)])
def test_service_tier(tier, priority):
    r = req(service_tier=tier)
    assert r.priority == priority
    assert am.reported_tier(r) == ("priority" if tier == "priority" else "standard")
    assert am.render_result(r, result("x", "stop"), "j1", 7).usage.service_tier == am.reported_tier(r)


def test_priority_of_tier():
    assert [priority_of_tier(t) for t in (None, "default", "auto", "flex", "priority")] == [None, None, None, 2, -1]
    assert (level_of(priority_of_tier("priority")), level_of(None), level_of(priority_of_tier("flex"))) == (0, 0, 2)
    with pytest.raises(InvalidRequest) as info:
        priority_of_tier("scale")
    assert info.value.param == "service_tier" and "'scale'" in info.value.message


def said(role: str, *blocks: dict) -> dict:
    return {"role": role, "content": list(blocks)}


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
FN = {"name": "f", "input_schema": {"type": "object"}}


@pytest.mark.parametrize("fields,message", [
    (dict(messages=[said("user", {"type": "image", "source": {}})]),
     "messages.0.content.0.source.type: Input should be 'base64' or 'url'"),
    (dict(messages=[said("user", {"type": "video", "source": {}})]),
     "messages.0.content.0: content blocks of type `video` are not supported by this server "
     "(text, image, tool use and thinking only)"),
    (dict(messages=[said("user", {"type": "document", "source": {}})]), "`document`"),
    (dict(messages=[said("user", TOOL_USE)]), "messages.0.content.0: `tool_use` blocks can only be in `assistant` "
                                             "messages"),
    (dict(messages=[*HI, said("assistant", {"type": "tool_result", "tool_use_id": "t"}), *HI]),
     "messages.1.content.0: `tool_result` blocks can only be in `user` messages"),
    (dict(messages=[said("user", {"type": "thinking", "thinking": "x", "signature": "s"})]),
     "`thinking` blocks can only be in `assistant` messages"),
    (dict(messages=[*HI, said("assistant", {"type": "tool_use", "id": "t", "name": "f"}), *HI]),
     "messages.1.content.0.input: Field required"),
    (dict(messages=[*HI, said("assistant", {"type": "tool_use", "name": "f", "input": {}}), *HI]),
     "messages.1.content.0.id: Field required"),
    (dict(messages=[said("user", {"type": "tool_result"})]), "messages.0.content.0.tool_use_id: Field required"),
    (dict(messages=[said("user", {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]})]),
     "messages.0.content.0.content.0.source: Field required"),
    (dict(messages=[said("user", {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]})]),
     "messages.0.content.0.content.0: content blocks of type `document` are not supported in a tool_result"),
    (dict(messages=[said("user", {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]})]),
     "messages.0.content.0.content.0.text: Field required"),
    (dict(messages=[*HI, said("assistant", {"type": "thinking", "signature": "s"}), *HI]),
     "messages.1.content.0.thinking: Field required"),
    (dict(messages=[*HI, said("assistant", TOOL_USE)], tools=[FN]),
     "messages.1: a final `assistant` turn with `tool_use` blocks cannot be continued"),
    (dict(messages=[said("user", {"type": "text"})]), "messages.0.content.0.text: Field required"),
    (dict(system=[{"type": "image"}]), "system.0: content blocks of type `image`"),
    (dict(tools=[{"name": "f"}]), "tools.0.input_schema: Field required"),
    (dict(tools=[{"type": "custom", "input_schema": {}}]), "tools.0.name: Field required"),
    (dict(tools=[FN, FN]), "tool names must be unique"),
    (dict(tool_choice={"type": "auto"}), "When using `tool_choice`, `tools` must be set."),
    (dict(tool_choice={"type": "any"}), "When using `tool_choice`, `tools` must be set."),
    (dict(tools=[FN], tool_choice={"type": "required"}), "tool_choice.type: Input should be 'auto', 'any', 'tool' "
                                                         "or 'none'"),
    (dict(tools=[FN], tool_choice={"type": "tool"}), "tool_choice.name: Field required"),
    (dict(tools=[FN], tool_choice={"type": "tool", "name": "g"}), "The tool specified in `tool_choice` does not "
                                                                  "match any of the specified `tools`"),
    (dict(tools=[FN, {"type": "web_search_20250305", "name": "web_search"}],
          tool_choice={"type": "tool", "name": "web_search"}),
     "tool_choice.name: `web_search` is an Anthropic-defined tool, which this server does not offer"),
    (dict(thinking={"type": "on"}), "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'"),
    (dict(thinking={"type": "enabled"}), "thinking.enabled.budget_tokens: Field required"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1023}, max_tokens=4096),
     "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1024),
     "max_tokens: `max_tokens` must be greater than `thinking.budget_tokens`"),
    (dict(output_config={"format": {"type": "xml"}}), "output_config.format.type: Input should be 'json_schema'"),
    (dict(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema: Field required"),
    (dict(messages=[]), "messages: at least one message is required"),
    (dict(messages=[{"role": "tool", "content": "x"}]),
     "messages.0.role: Input should be 'user', 'assistant' or 'system'"),
    (dict(stop_sequences=[""]), "stop_sequences: each stop sequence must be a non-empty string"),
    (dict(service_tier="scale"), "service_tier must be one of"),
])
def test_refusals(fields, message):
    assert message in refused(**fields).message


def test_harmless_forms_are_accepted():
    r = req(tools=[], tool_choice={"type": "none"}, thinking={"type": "disabled"}, container=None, speed="standard")
    assert r.messages == [ChatMessage(role="user", content="hi")] and r.tools is None
    assert r.chat.template_kwargs == {"enable_thinking": False}
    assert req(tool_choice={"type": "none"}).tools is None


@pytest.mark.parametrize("fields", [dict(temperature=1.5), dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.1),
                                    dict(top_k=-1), dict(max_tokens=0), dict(model=None), dict(messages=None)])
def test_ranges_and_required_fields_fail_validation(fields):
    with pytest.raises(msgspec.ValidationError):
        body(**fields)


def test_count_tokens_body_is_the_create_body_without_max_tokens():
    count = msgspec.convert({"model": "claude", "messages": HI, "system": "s"}, am.CountTokensRequest)
    chat, options, tools = am.chat_of(count)
    assert chat == [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="hi")]
    assert options.add_generation_prompt and tools is None
    assert (chat, options) == (req(system="s").messages, req(system="s").chat)


# --- tools, tool history and thinking ---------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True,
           "cache_control": {"type": "ephemeral"}}
WEATHER_TOOL = Tool(name="get_weather", description="The weather in a city",
                    parameters={"type": "object", "properties": {"city": {"type": "string"}}}, strict=True)


def test_custom_tools_are_the_chat_functions_and_the_default_choice_is_auto():
    r = req(tools=[WEATHER, {"type": "custom", "name": "noop", "input_schema": {"type": "object"}}])
    assert r.tools == ToolUse(tools=[WEATHER_TOOL, Tool(name="noop", parameters={"type": "object"})],
                              choice="auto", parallel=True)


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, ("auto", None, True)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather", True)),
    ({"type": "none"}, ("none", None, True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None, False)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False)),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": False}, ("function", "get_weather", True)),
])
def test_tool_choice(choice, expected):
    t = req(tools=[WEATHER], tool_choice=choice).tools
    assert (t.choice, t.function, t.parallel) == expected and t.tools == [WEATHER_TOOL]


def test_anthropic_defined_tools_are_left_out():
    hosted = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
              {"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728", "name": "str_replace"},
              {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
              {"type": "mcp_toolset", "mcp_server_name": "x"}]
    assert req(tools=[*hosted, WEATHER]).tools == ToolUse(tools=[WEATHER_TOOL])
    assert req(tools=hosted).tools is None  # nothing this server runs: a chat without tools
    assert req(tools=hosted, tool_choice={"type": "any"}).tools is None


def test_tool_history_maps_to_calls_and_tool_turns():
    """Thinking, text and two parallel calls in the assistant turn; their results (a string, text
    blocks, a failure) and the user's text in the next: the tool turns first, then the text."""
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        said("assistant", {"type": "thinking", "thinking": "Two cities.", "signature": "EqQBCkYI"},
             {"type": "redacted_thinking", "data": "EmwKAhgB"},
             {"type": "text", "text": "Checking both."},
             {"type": "tool_use", "id": "toolu_j1_0", "name": "get_weather", "input": {"city": "Paris", "n": [1, 2]},
              "cache_control": {"type": "ephemeral"}},
             {"type": "tool_use", "id": "toolu_j1_1", "name": "get_weather", "input": {}}),
        said("user", {"type": "tool_result", "tool_use_id": "toolu_j1_0", "content": "sunny",
                      "cache_control": {"type": "ephemeral"}},
             {"type": "text", "text": "Also:"},
             {"type": "tool_result", "tool_use_id": "toolu_j1_1", "is_error": True,
              "content": [{"type": "text", "text": "no such"}, {"type": "text", "text": "city"}]},
             {"type": "text", "text": "thanks"}),
    ]
    r = req(messages=messages, tools=[WEATHER])
    assert r.messages == [
        ChatMessage(role="user", content="Weather in Paris and Rome?"),
        ChatMessage(role="assistant", content="Checking both.", reasoning="Two cities.", tool_calls=[
            ToolCall(id="toolu_j1_0", name="get_weather", arguments='{"city":"Paris","n":[1,2]}'),
            ToolCall(id="toolu_j1_1", name="get_weather", arguments="{}")]),
        ChatMessage(role="tool", content="sunny", tool_call_id="toolu_j1_0"),
        ChatMessage(role="tool", content="Error: no such\ncity", tool_call_id="toolu_j1_1"),
        ChatMessage(role="user", content="Also:\nthanks"),
    ]
    assert r.chat.add_generation_prompt and not r.chat.continue_final_message


def test_tool_results_alone_are_tool_turns_only():
    messages = [*HI, said("assistant", {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}),
                said("user", {"type": "tool_result", "tool_use_id": "toolu_a"}),
                said("user", {"type": "tool_result", "tool_use_id": "toolu_b", "content": [], "is_error": True})]
    assert req(messages=messages, tools=[WEATHER]).messages[2:] == [
        ChatMessage(role="tool", content="", tool_call_id="toolu_a"),
        ChatMessage(role="tool", content="Error", tool_call_id="toolu_b")]


def test_a_call_id_reaches_the_template_as_the_client_sent_it_back():
    """Our response's ``toolu_<x>`` comes back as the call's id and its result's ``tool_use_id``:
    both are passed through unchanged, so the template pairs them."""
    call = ToolCall(id="call_j9_0", name="get_weather", arguments='{"city":"Oslo"}')
    answer = am.render_result(req(), JobResult(choices=[Choice(tool_calls=[call], finish_reason="tool_calls")]),
                              "j9", 1)
    sent_back = msgspec.to_builtins(answer.content)
    r = req(tools=[WEATHER], messages=[*HI, {"role": "assistant", "content": sent_back},
                                       said("user", {"type": "tool_result", "tool_use_id": sent_back[0]["id"],
                                                     "content": "cold"})])
    assert r.messages[1].tool_calls[0].id == r.messages[2].tool_call_id == "toolu_j9_0"
    assert r.messages[1].tool_calls[0].arguments == call.arguments


def test_an_assistant_prefill_keeps_its_thinking():
    r = req(messages=[*HI, said("assistant", {"type": "thinking", "thinking": "a", "signature": ""},
                                {"type": "thinking", "thinking": "b", "signature": ""}, {"type": "text", "text": "{"})])
    assert r.messages[-1] == ChatMessage(role="assistant", content="{", reasoning="a\nb")
    assert r.chat.continue_final_message


def test_system_forms_and_the_billing_header():
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.160; cch=9f2e;"}
    cached = {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert req(system=[billing, cached, {"type": "text", "text": "Be brief."}]).messages[0] == ChatMessage(
        role="system", content="You are Claude Code.\nBe brief.")
    assert req(system=[billing]).messages == [ChatMessage(role="user", content="hi")]
    # A system turn inside messages (Claude Code 2.1.154+) stays in place; one saying nothing is no turn.
    messages = [*HI, {"role": "system", "content": "reminder"}, {"role": "assistant", "content": "ok"},
                said("system", billing), *HI, {"role": "system", "content": [cached]}]
    assert req(system="top", messages=messages).messages == [
        ChatMessage(role="system", content="top"), ChatMessage(role="user", content="hi"),
        ChatMessage(role="system", content="reminder"), ChatMessage(role="assistant", content="ok"),
        ChatMessage(role="user", content="hi"), ChatMessage(role="system", content="You are Claude Code.")]


@pytest.mark.parametrize("fields,kwargs", [
    (dict(), {}),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048), {"enable_thinking": True}),
    (dict(thinking={"type": "adaptive", "budget_tokens": 0, "display": "omitted"}), {"enable_thinking": True}),
    (dict(thinking={"type": "disabled"}), {"enable_thinking": False}),
    (dict(output_config={"effort": "high"}), {"reasoning_effort": "high"}),
    (dict(thinking={"type": "adaptive"}, output_config={"effort": "max"}),
     {"enable_thinking": True, "reasoning_effort": "max"}),
])
def test_thinking_and_effort_are_template_kwargs(fields, kwargs):
    assert req(**fields).chat.template_kwargs == kwargs


def test_what_claude_code_adds_is_accepted_and_changes_nothing():
    """cache_control on every kind of block and on tools, metadata, context_management, beta-era
    fields and unknown ones: the same job as the plain request."""
    uncached = {k: v for k, v in WEATHER.items() if k != "cache_control"}
    plain = dict(system=[{"type": "text", "text": "s"}], tools=[uncached],
                 messages=[said("user", {"type": "text", "text": "hi"})])
    decorated = dict(
        system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}], tools=[WEATHER],
        messages=[said("user", {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}})],
        metadata={"user_id": "user_abc_account_x_session_y"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        mcp_servers=[], container=None, betas=["interleaved-thinking-2025-05-14"],
    )
    assert req(**decorated) == req(**plain)


def test_count_tokens_has_the_tools_the_worker_renders():
    fields = dict(tools=[WEATHER], tool_choice={"type": "any"}, thinking={"type": "adaptive"},
                  messages=[*HI, said("assistant", {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {}}),
                            said("user", {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"})])
    count = msgspec.convert({"model": "claude", **fields}, am.CountTokensRequest)
    r = req(**fields)
    assert am.chat_of(count) == (r.messages, r.chat, r.tools)



# --- the message ----------------------------------------------------------------------------------


def result(text: str, finish: str, stop_reason: str | int | None = None) -> JobResult:
    return JobResult(choices=[Choice(text=text, finish_reason=finish, stop_reason=stop_reason)],
                     usage=Usage(prompt_tokens=12, completion_tokens=3))


def test_render_result_bytes():
    r = msgspec.structs.replace(req(), model="tiny")
    assert encode(am.render_result(r, result("Hi!", "stop"), "j1", 7)) == (
        b'{"id":"msg_j1","type":"message","role":"assistant","content":[{"type":"text","text":"Hi!"}],'
        b'"model":"tiny","stop_reason":"end_turn","stop_sequence":null,'
        b'"usage":{"input_tokens":12,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
        b'"cache_creation":null,"output_tokens":3,"output_tokens_details":null,"server_tool_use":null,'
        b'"service_tier":"standard","inference_geo":null}}'
    )


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("stop", None, ("end_turn", None)),
    ("stop", 7, ("end_turn", None)),  # a stop token id (the model's other EOS ids) ends the turn
    ("stop", "END", ("stop_sequence", "END")),
    ("length", None, ("max_tokens", None)),
])
def test_stop_reasons(finish, stop_reason, expected):
    msg = am.render_result(req(), result("x", finish, stop_reason), "j1", 7)
    assert (msg.stop_reason, msg.stop_sequence) == expected


def test_the_sdk_parses_the_message():
    from anthropic.types import Message

    msg = Message.model_validate_json(encode(am.render_result(req(), result("x", "length"), "j1", 7)))
    assert (msg.content[0].text, msg.stop_reason, msg.usage.input_tokens, msg.usage.service_tier) == (
        "x", "max_tokens", 12, "standard")


# --- the stream -----------------------------------------------------------------------------------


MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_j1","type":"message",'
    b'"role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":0,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
    b'"cache_creation":null,"output_tokens":1,"output_tokens_details":null,"server_tool_use":null,'
    b'"service_tier":"standard","inference_geo":null}}}\n\n'
)
BLOCK_START = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
               b'"content_block":{"type":"text","text":""}}\n\n')
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def text_delta(text: bytes) -> bytes:
    return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"' + text + b'"}}\n\n')


def message_delta(stop_reason: bytes, stop_sequence: bytes, inputs: int, outputs: int) -> bytes:
    return (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":' + stop_reason
            + b',"stop_sequence":' + stop_sequence + b'},"usage":{"input_tokens":%d,"output_tokens":%d}}\n\n'
            % (inputs, outputs))


async def test_stream_bytes_in_anthropics_order():
    r = msgspec.structs.replace(req(), model="tiny")
    events = [
        Keepalive(),
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="He")]),
        Tokens(seq=2, deltas=[TokenDelta(token_ids=[6], text="")]),  # no text yet: no delta
        Keepalive(),
        Done(seq=3, deltas=[TokenDelta(token_ids=[7], text="llo", finish_reason="stop", stop_reason="END")],
             usage=Usage(prompt_tokens=9, completion_tokens=3)),
    ]
    assert await frames(r, events) == [
        KEEPALIVE, MESSAGE_START, BLOCK_START, PING, text_delta(b"He"), KEEPALIVE, text_delta(b"llo"), BLOCK_STOP,
        message_delta(b'"stop_sequence"', b'"END"', 9, 3), MESSAGE_STOP,
    ]


async def test_stream_that_ends_at_once():
    """A job whose only event is its Done still opens and closes the message."""
    r = msgspec.structs.replace(req(), model="tiny")
    done = Done(seq=1, deltas=[TokenDelta(token_ids=[2], text="", finish_reason="stop")],
                usage=Usage(prompt_tokens=4, completion_tokens=1))
    assert await frames(r, [done]) == [MESSAGE_START, BLOCK_START, PING, BLOCK_STOP,
                                       message_delta(b'"end_turn"', b"null", 4, 1), MESSAGE_STOP]
    length = Done(seq=1, deltas=[TokenDelta(token_ids=[2], text="x", finish_reason="length")],
                  usage=Usage(prompt_tokens=4, completion_tokens=1))
    assert (await frames(r, [length]))[-2] == message_delta(b'"max_tokens"', b"null", 4, 1)


ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
         b'"message":"engine broke"}}\n\n')


async def test_an_error_mid_stream_is_one_error_event_that_ends_it():
    r = msgspec.structs.replace(req(), model="tiny")
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")]),
              Error(seq=2, code=GenerationFailed.code, message="engine broke", status=500),
              Tokens(seq=3, deltas=[TokenDelta(token_ids=[5], text="never")])]
    assert await frames(r, events) == [MESSAGE_START, BLOCK_START, PING, text_delta(b"a"), ERROR]


async def test_a_relay_failure_is_an_error_event_too():
    async def broken():
        yield Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")])
        raise QueueUnavailable("the queue is unavailable")

    r = msgspec.structs.replace(req(), model="tiny")
    out = await rendered(am.MessageStream(r, "j1"), broken())
    assert out[-1] == (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                       b'"message":"the queue is unavailable"}}\n\n')


async def test_the_sdk_accumulates_the_stream():
    """The SDK's own SSE decoder and accumulator over our bytes, keep-alive comments included."""
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    r = msgspec.structs.replace(req(), model="tiny")
    events = [Keepalive(), Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="He")]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[7], text="y", finish_reason="length")],
                   usage=Usage(prompt_tokens=9, completion_tokens=2))]
    raw = b"".join(await frames(r, events))
    adapter, snapshot = TypeAdapter(RawMessageStreamEvent), None
    for sse in SSEDecoder().iter_bytes(iter([raw])):
        if sse.event == "ping":
            continue
        snapshot = accumulate_event(event=adapter.validate_python(sse.json()), current_snapshot=snapshot,
                                    json_bufs={})
    assert snapshot.content[0].text == "Hey" and snapshot.stop_reason == "max_tokens"
    assert (snapshot.usage.input_tokens, snapshot.usage.output_tokens) == (9, 2)


# --- thinking and tool use in the answer ------------------------------------------------------------

SIG_0 = "6lKyR/nV8a4i3xAu8oKjT/SFd2T4qfsPOIOWEAQMu4E="  # base64(sha256("llmq-thinking:j1:0"))
PARIS = ToolCall(id="call_j1_0", name="get_weather", arguments='{"city": "Paris"}')
ROME = ToolCall(id="call_j1_1", name="get_weather", arguments='{"city":"Rome"}')
USAGE_BYTES = (b'"usage":{"input_tokens":12,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
               b'"cache_creation":null,"output_tokens":3,"output_tokens_details":null,"server_tool_use":null,'
               b'"service_tier":"standard","inference_geo":null}}')


def called(text: str = "", reasoning: str | None = None, calls=(), finish: str = "tool_calls",
           stop_reason: str | None = None) -> JobResult:
    return JobResult(choices=[Choice(text=text, reasoning=reasoning, tool_calls=list(calls) or None,
                                     finish_reason=finish, stop_reason=stop_reason)],
                     usage=Usage(prompt_tokens=12, completion_tokens=3))


def test_signatures_and_ids_are_derived_from_the_job():
    assert signature("j1", 0) == SIG_0 == signature("j1", 0) != signature("j1", 1) != signature("j2", 0)
    assert (tool_use_id("call_j1_0"), tool_use_id("call_j1_2_0")) == ("toolu_j1_0", "toolu_j1_2_0")


def test_render_result_bytes_with_thinking_text_and_two_calls():
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    msg = am.render_result(r, called("Checking.", "Two cities.", [PARIS, ROME]), "j1", 7)
    assert encode(msg) == (
        b'{"id":"msg_j1","type":"message","role":"assistant","content":['
        b'{"type":"thinking","thinking":"Two cities.","signature":"' + SIG_0.encode() + b'"},'
        b'{"type":"text","text":"Checking."},'
        b'{"type":"tool_use","id":"toolu_j1_0","name":"get_weather","input":{"city":"Paris"}},'
        b'{"type":"tool_use","id":"toolu_j1_1","name":"get_weather","input":{"city":"Rome"}}],'
        b'"model":"tiny","stop_reason":"tool_use","stop_sequence":null,' + USAGE_BYTES)


def test_a_message_of_calls_only_has_no_text_block():
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    assert encode(am.render_result(r, called(calls=[PARIS]), "j1", 7)) == (
        b'{"id":"msg_j1","type":"message","role":"assistant","content":['
        b'{"type":"tool_use","id":"toolu_j1_0","name":"get_weather","input":{"city":"Paris"}}],'
        b'"model":"tiny","stop_reason":"tool_use","stop_sequence":null,' + USAGE_BYTES)
    thinking_only = am.render_result(r, called(reasoning="hmm", finish="length"), "j1", 7)
    assert [b["type"] for b in msgspec.to_builtins(thinking_only.content)] == ["thinking"]
    assert thinking_only.stop_reason == "max_tokens"


@pytest.mark.parametrize("calls,finish,stop_reason,expected", [
    ([PARIS], "tool_calls", None, ("tool_use", None)),
    ([PARIS], "stop", None, ("tool_use", None)),  # a forced (named) call finishes with `stop`: still tool_use
    ([PARIS], "stop", 7, ("tool_use", None)),
    ([PARIS, ROME], "stop", "END", ("tool_use", None)),  # a stop string after whole calls
    ([ToolCall(id="call_j1_0", name="f", arguments='{"city": "Pa')], "stop", "END", ("stop_sequence", "END")),
    ([ToolCall(id="call_j1_0", name="f", arguments='{"city": "Pa')], "length", None, ("max_tokens", None)),
    # Only a stop string cuts a call short: after EOS its arguments are what the model said.
    ([ToolCall(id="call_j1_0", name="f", arguments='{"city": "Pa')], "tool_calls", None, ("tool_use", None)),
    ([PARIS], "length", None, ("max_tokens", None)),
    ([], "tool_calls", None, ("end_turn", None)),  # no call came out: the message does not end with one
])
def test_stop_reason_with_calls(calls, finish, stop_reason, expected):
    msg = am.render_result(req(tools=[WEATHER]), called("x", calls=calls, finish=finish, stop_reason=stop_reason),
                           "j1", 7)
    assert (msg.stop_reason, msg.stop_sequence) == expected


def test_a_call_cut_short_has_an_empty_input():
    cut = ToolCall(id="call_j1_0", name="get_weather", arguments='{"city": "Pa')
    not_an_object = ToolCall(id="call_j1_1", name="get_weather", arguments="[1]")
    msg = am.render_result(req(tools=[WEATHER]), called(calls=[cut, not_an_object], finish="length"), "j1", 7)
    assert [b.input for b in msg.content] == [{}, {}]


def test_the_sdk_parses_a_message_with_thinking_and_calls():
    from anthropic.types import Message

    msg = Message.model_validate_json(encode(am.render_result(req(), called("a", "b", [PARIS, ROME]), "j1", 7)))
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert (msg.content[0].signature, msg.content[2].input, msg.content[3].id) == (SIG_0, {"city": "Paris"},
                                                                                   "toolu_j1_1")


def frame(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()


def block_start(index: int, block: str) -> bytes:
    return frame("content_block_start", f'{{"type":"content_block_start","index":{index},"content_block":{block}}}')


def block_delta(index: int, delta: str) -> bytes:
    return frame("content_block_delta", f'{{"type":"content_block_delta","index":{index},"delta":{delta}}}')


def block_stop(index: int) -> bytes:
    return frame("content_block_stop", f'{{"type":"content_block_stop","index":{index}}}')


def tool_start(index: int, call: int) -> bytes:
    return block_start(index, f'{{"type":"tool_use","id":"toolu_j1_{call}","name":"get_weather","input":{{}}}}')


def json_delta(index: int, partial: str) -> bytes:
    return block_delta(index, msgspec.json.encode({"type": "input_json_delta", "partial_json": partial}).decode())


THINKING_START = block_start(0, '{"type":"thinking","thinking":"","signature":""}')
SIGNATURE_0 = block_delta(0, f'{{"type":"signature_delta","signature":"{SIG_0}"}}')


def calls(*pieces: ToolCallDelta) -> TokenDelta:
    return TokenDelta(token_ids=[1], tool_calls=list(pieces))


def piece(index: int, arguments: str = "", first: bool = False) -> ToolCallDelta:
    if first:
        return ToolCallDelta(index=index, id=f"call_j1_{index}", name="get_weather", arguments=arguments)
    return ToolCallDelta(index=index, arguments=arguments)


# Thinking, then text, then two calls whose pieces arrive across events (call 1 opens in the
# event that finishes call 0); a keep-alive and a held-back token in between.
FULL_EVENTS = [
    Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], reasoning="Two ")]),
    Tokens(seq=2, deltas=[TokenDelta(token_ids=[2], reasoning="cities.")]),
    Tokens(seq=3, deltas=[TokenDelta(token_ids=[3], text="Checking.")]),
    Tokens(seq=4, deltas=[TokenDelta(token_ids=[4])]),  # the parser holds text back: nothing
    Tokens(seq=5, deltas=[calls(piece(0, first=True))]),
    Keepalive(),
    Tokens(seq=6, deltas=[calls(piece(0, '{"city": '))]),
    Tokens(seq=7, deltas=[calls(piece(0, '"Paris"}'), piece(1, '{"city":', first=True))]),
    Done(seq=8, deltas=[TokenDelta(token_ids=[8], tool_calls=[piece(1, '"Rome"}')], finish_reason="tool_calls")],
         usage=Usage(prompt_tokens=40, completion_tokens=8)),
]


async def test_stream_bytes_with_thinking_text_and_two_calls():
    """Each block in the final content's order, its index that position; the thinking block's
    signature_delta just before its stop; each argument piece one input_json_delta."""
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    assert await frames(r, FULL_EVENTS) == [
        MESSAGE_START, THINKING_START, PING,
        block_delta(0, '{"type":"thinking_delta","thinking":"Two "}'),
        block_delta(0, '{"type":"thinking_delta","thinking":"cities."}'),
        SIGNATURE_0, block_stop(0),
        block_start(1, '{"type":"text","text":""}'), block_delta(1, '{"type":"text_delta","text":"Checking."}'),
        block_stop(1), tool_start(2, 0),
        KEEPALIVE,
        json_delta(2, '{"city": '),
        json_delta(2, '"Paris"}'), block_stop(2), tool_start(3, 1), json_delta(3, '{"city":'),
        json_delta(3, '"Rome"}'), block_stop(3),
        message_delta(b'"tool_use"', b"null", 40, 8), MESSAGE_STOP,
    ]


async def test_stream_of_calls_only_in_one_event_each():
    """A call-only message (a forced choice: finish ``stop``): no text block; two calls in one
    event are two blocks."""
    r = msgspec.structs.replace(req(tools=[WEATHER], tool_choice={"type": "any"}), model="tiny")
    events = [Tokens(seq=1, deltas=[calls(piece(0, '{"city":"Paris"}', first=True),
                                          piece(1, '{"city":"Rome"}', first=True))]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[2], finish_reason="stop")],
                   usage=Usage(prompt_tokens=9, completion_tokens=2))]
    assert await frames(r, events) == [
        MESSAGE_START, tool_start(0, 0), PING, json_delta(0, '{"city":"Paris"}'), block_stop(0),
        tool_start(1, 1), json_delta(1, '{"city":"Rome"}'), block_stop(1),
        message_delta(b'"tool_use"', b"null", 9, 2), MESSAGE_STOP,
    ]


async def test_reasoning_and_text_in_one_delta_close_the_thinking_block_first():
    r = msgspec.structs.replace(req(), model="tiny")
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1])]),  # nothing parsed yet: the message opens alone
              Done(seq=2, deltas=[TokenDelta(token_ids=[2], reasoning="hm", text="Hi", finish_reason="stop")],
                   usage=Usage(prompt_tokens=4, completion_tokens=2))]
    assert await frames(r, events) == [
        MESSAGE_START, PING, THINKING_START, block_delta(0, '{"type":"thinking_delta","thinking":"hm"}'),
        SIGNATURE_0, block_stop(0), block_start(1, '{"type":"text","text":""}'),
        block_delta(1, '{"type":"text_delta","text":"Hi"}'), block_stop(1),
        message_delta(b'"end_turn"', b"null", 4, 2), MESSAGE_STOP,
    ]


async def test_a_stop_string_cutting_a_call_short_is_stop_sequence_in_the_stream_too():
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    events = [Tokens(seq=1, deltas=[calls(piece(0, '{"city": "Pa', first=True))]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[2], finish_reason="stop", stop_reason="END")],
                   usage=Usage(prompt_tokens=4, completion_tokens=2))]
    assert (await frames(r, events))[-2] == message_delta(b'"stop_sequence"', b'"END"', 4, 2)


@pytest.mark.parametrize("late", [
    piece(0, '"x"}'),  # call 0's block already closed: call 1 opened
    piece(2, '{}'),  # call 2 never opened
    piece(0, '{}', first=True),  # call 0 opened twice
])
async def test_a_piece_for_a_closed_or_unknown_call_ends_the_stream_with_an_error(late):
    """The worker sends each call's pieces in order, so this cannot happen; were it to, the stream
    ends with an error event rather than arguments in the wrong block (or dropped)."""
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    events = [Tokens(seq=1, deltas=[calls(piece(0, "{", first=True))]),
              Tokens(seq=2, deltas=[calls(piece(0, "}"), piece(1, "{}", first=True))]),
              Tokens(seq=3, deltas=[calls(late)]),
              Done(seq=4, deltas=[TokenDelta(token_ids=[4], finish_reason="tool_calls")])]
    out = await frames(r, events)
    assert out[:-1] == [MESSAGE_START, tool_start(0, 0), PING, json_delta(0, "{"), json_delta(0, "}"),
                        block_stop(0), tool_start(1, 1), json_delta(1, "{}")]
    assert out[-1].startswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"')


def _accumulate(raw: bytes):
    """The SDK's own SSE decoder and accumulator (strict types: each event validated) over ``raw``."""
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter, snapshot, bufs = TypeAdapter(RawMessageStreamEvent), None, {}
    for sse in SSEDecoder().iter_bytes(iter([raw])):
        if sse.event != "ping":
            snapshot = accumulate_event(event=adapter.validate_python(sse.json()), current_snapshot=snapshot,
                                        json_bufs=bufs)
    return snapshot


async def test_the_stream_accumulates_to_the_message_create_returns():
    """The SDK's accumulation of the stream is the non-streamed message of the same events."""
    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    snapshot = _accumulate(b"".join(await frames(r, FULL_EVENTS)))
    builder = ResultBuilder()
    for e in FULL_EVENTS:
        if not isinstance(e, Keepalive):
            builder.add(e)
    created = msgspec.to_builtins(am.render_result(r, builder.result(), "j1", 7))
    streamed = snapshot.model_dump(mode="json", exclude_none=True)
    assert [{k: v for k, v in b.items() if k != "caller"} for b in streamed["content"]] == created["content"]
    assert (snapshot.stop_reason, snapshot.usage.input_tokens, snapshot.usage.output_tokens) == ("tool_use", 40, 8)


async def test_the_sdk_client_streams_our_bytes_to_a_final_message():
    """The real client (``messages.stream`` over an httpx transport that answers with our bytes):
    the final message has the thinking block with its signature and the calls with parsed input."""
    import anthropic
    import httpx2

    r = msgspec.structs.replace(req(tools=[WEATHER]), model="tiny")
    raw = b"".join(await frames(r, FULL_EVENTS))

    def answer(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/messages"
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    client = anthropic.Anthropic(api_key="x", base_url="http://llmq", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
    with client.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                tools=[WEATHER]) as s:
        final = s.get_final_message()
    thinking, text, paris, rome = final.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "Two cities.", SIG_0)
    assert (text.type, text.text) == ("text", "Checking.")
    assert [(b.type, b.id, b.name, b.input) for b in (paris, rome)] == [
        ("tool_use", "toolu_j1_0", "get_weather", {"city": "Paris"}),
        ("tool_use", "toolu_j1_1", "get_weather", {"city": "Rome"})]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 8



# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc,status,kind", [
    (InvalidRequest("bad"), 400, "invalid_request_error"),
    (Unauthorized("who"), 401, "authentication_error"),
    (ModelNotFound("nope"), 404, "not_found_error"),
    (PayloadTooLarge("big"), 413, "request_too_large"),
    (Overloaded("full"), 529, "overloaded_error"),
    (GenerationFailed("boom"), 500, "api_error"),
    (QueueUnavailable("down"), 503, "api_error"),
    (DeadlineExceeded("late"), 504, "timeout_error"),
    (ServiceError("x"), 500, "api_error"),
])
def test_error_statuses_and_types(exc, status, kind):
    got, err = am.error_body(exc)
    assert got == status
    assert encode(err) == b'{"type":"error","error":{"type":"%s","message":"%s"}}' % (kind.encode(),
                                                                                       exc.message.encode())


def test_a_429_other_than_the_full_queue_is_a_rate_limit():
    exc = ServiceError("slow down")
    exc.status, exc.code = 429, "rate_limited"
    assert am.error_body(exc)[0] == 429 and am.error_body(exc)[1].error.type == "rate_limit_error"
    exc.status, exc.code = 405, "http_error"  # Litestar's own 4xx keep their status
    assert am.error_body(exc)[0] == 405 and am.error_body(exc)[1].error.type == "invalid_request_error"


# --- fuzzing: any body is a request or a 4xx ------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(anthropic_bodies)
def test_any_body_translates_or_is_refused_with_a_4xx(raw: bytes):
    try:
        try:
            b = json_input.decode(raw, json_input.decoder_for(am.MessagesRequest))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidRequest(str(exc)) from None
        r = am.to_generation_request(b)
        check_queueable(r)
    except ServiceError as exc:
        assert 400 <= exc.status < 500, exc.message
        return
    assert decode_request(encode(r)) == r
