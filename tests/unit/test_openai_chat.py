"""OpenAI chat completions: translation, vLLM's validation messages, and the rendered bytes."""

from __future__ import annotations

import msgspec
import pytest

from api.dialects import openai_chat as chat
from api.dialects.openai_chat_render import ChatCompletionMessage
from shared.codec import encode
from shared.errors import InvalidRequest
from shared.events import Done, Error, TokenDelta, Tokens, ToolCallDelta
from shared.framing import KEEPALIVE, SSE_DONE, Keepalive
from shared.schemas import ChatMessage, Choice, JobResult, StructuredOutput, Tool, ToolCall, ToolUse, TopLogprob, Usage
from tests.support.streams import frames as rendered

MAX_LEN = 1024
HI = [{"role": "user", "content": "hi"}]


def req(body: dict):
    return chat.to_generation_request(msgspec.convert(body, chat.ChatRequest), max_model_len=MAX_LEN)


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        req(body)
    return info.value


async def frames(r, events, *, sse_format=True) -> list[bytes]:
    return await rendered(chat.ChatStream(r, "j1", 7, sse_format=sse_format), events)


# --- translation ----------------------------------------------------------------------------


def test_defaults_match_vllm_chat():
    r = req({"messages": HI})
    s = r.sampling
    assert r.messages == [ChatMessage(role="user", content="hi")] and r.prompt is None
    assert (s.n, s.temperature, s.top_p, s.top_k, s.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert s.logprobs is None and s.structured is None
    assert s.max_tokens == MAX_LEN - 1  # null max_tokens: up to the context, the engine stops at its end
    assert r.chat.add_generation_prompt and not r.chat.continue_final_message and r.chat.template_kwargs == {}
    assert r.dialect == "openai_chat" and r.model == "" and not r.output.include_usage


def test_messages_keep_roles_and_names_and_flatten_text_parts_with_newlines():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "name": "ann", "content": parts}]
    messages += [{"role": "assistant", "content": None}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    r = req({"messages": messages})
    assert r.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="a\nb", name="ann"),
        ChatMessage(role="assistant", content=""),
        ChatMessage(role="tool", content="42", tool_call_id="call_1"),
    ]


def test_every_sampling_field_is_mapped():
    body = {"messages": HI, "model": "m", "temperature": 0.5, "top_p": 0.9, "n": 3, "stop": "\n", "seed": 11}
    body |= {"max_tokens": 9, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"5": -100}}
    body |= {"ignore_eos": True, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "priority": 3}
    body |= {"stop_token_ids": [7], "include_stop_str_in_output": True, "skip_special_tokens": False}
    r = req({**body, "stream": True, "stream_options": {"include_usage": True}})
    s = r.sampling
    assert (s.temperature, s.top_p, s.n, s.stop, s.seed, s.max_tokens) == (0.5, 0.9, 3, ["\n"], 11, 9)
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias, s.ignore_eos) == (0.5, -0.5, {5: -100.0}, True)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (4, 0.1, 1.2, 2)
    assert (s.stop_token_ids, s.include_stop_str_in_output, s.skip_special_tokens) == ([7], True, False)
    assert (r.model, r.priority, r.output.include_usage) == ("m", 3, True)
    assert req({"messages": HI, "seed": -1, "stop": ["a", "b"]}).sampling.seed is None  # -1: no seed, as vLLM
    assert req({"messages": HI, "stop": ["a", "b"]}).sampling.stop == ["a", "b"]


def test_max_completion_tokens_wins_over_max_tokens():
    assert req({"messages": HI, "max_tokens": 5, "max_completion_tokens": 3}).sampling.max_tokens == 3
    assert req({"messages": HI, "max_completion_tokens": None, "max_tokens": 5}).sampling.max_tokens == 5


def test_logprobs_and_top_logprobs():
    assert req({"messages": HI, "logprobs": True}).sampling.logprobs == 0
    assert req({"messages": HI, "logprobs": True, "top_logprobs": 5}).sampling.logprobs == 5
    assert req({"messages": HI, "logprobs": False, "top_logprobs": 0}).sampling.logprobs is None
    assert req({"messages": HI, "top_logprobs": None}).sampling.logprobs is None
    err = refused({"messages": HI, "top_logprobs": 2})
    assert err.message == "when using `top_logprobs`, `logprobs` must be set to true." and err.param == "top_logprobs"


def test_chat_template_options():
    options = {"add_generation_prompt": False, "continue_final_message": True}
    r = req({"messages": HI, **options, "chat_template_kwargs": {"enable_thinking": False}})
    assert not r.chat.add_generation_prompt and r.chat.continue_final_message
    assert r.chat.template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            StructuredOutput(json={"type": "object"}),
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=["yes", "no"])),
        ({"structured_outputs": {"regex": "[0-9]+", "whitespace_pattern": " "}}, StructuredOutput(regex="[0-9]+")),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutput(json_object=True),
        ),  # an engine-wide option in vLLM 0.32: accepted, ignored per request
        ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutput(json={"type": "integer"})),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput(grammar='root ::= "a"')),
        (
            {
                "structured_outputs": {"json": {"type": "object"}},
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}},
            },
            StructuredOutput(json={"type": "array"}),
        ),  # response_format overrides, as in vLLM
    ],
)
def test_response_format_and_structured_outputs(extra, expected):
    assert req({"messages": HI, **extra}).sampling.structured == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
        ({"stream_options": {"include_usage": True}}, "Stream options can only be defined when `stream=True`."),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens must be less than or equal to max_tokens=2, got 3."),
        ({"stop": ["a", ""]}, "stop cannot contain an empty string."),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
        ),
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        ({"echo": True}, "`echo` is not supported by this server"),
        (
            {"chat_template": "{{ x }}"},
            "a per-request `chat_template` is not supported; the model's own template is used",
        ),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "`stream_options.continuous_usage_stats` is not supported",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "When response_format type is 'json_schema', the 'json_schema' field (with a 'schema') must be provided.",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format type must be 'text', 'json_object' or 'json_schema', got 'xml'",
        ),
        (
            {"structured_outputs": {"choice": ["a"], "regex": "a"}},
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
        ),
        ({"structured_outputs": {"json": "[1, 2"}}, "structured_outputs.json must be a JSON object"),
        (
            {"chat_template_kwargs": {"tokenize": False, "chat_template": "x"}},
            "chat_template_kwargs may not set chat_template, tokenize",
        ),
    ],
)
def test_invalid_requests_get_vllms_message(extra, message):
    assert refused({"messages": HI, **extra}).message == message


def test_structured_outputs_need_exactly_one_constraint():
    one = "structured output needs exactly one of json, json_object, regex, choice, grammar"
    assert refused({"messages": HI, "structured_outputs": {}}).message == one
    both = {"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}}
    assert refused({"messages": HI, **both}).message == one  # response_format adds to it, as in vLLM
    empty = refused({"messages": HI, "structured_outputs": {"choice": []}})
    assert empty.message == "structured output `choice` must not be empty" and empty.param == "structured_outputs"


def test_content_other_than_text_and_images_is_refused():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    err = refused({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, audio]}]})
    assert err.message == "messages[0]: content parts of type `input_audio` are not supported (text and image_url only)"


BAD_RANGES = [{"temperature": 2.5}, {"top_p": 0}, {"n": 0}, {"top_logprobs": 21, "logprobs": True}]
BAD_RANGES += [{"max_tokens": 0}, {"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"min_p": 1.5}]
BAD_RANGES += [{"top_k": -2}, {"repetition_penalty": 0}, {"min_tokens": -1}, {"messages": "hi"}, {"logprobs": "x"}]


@pytest.mark.parametrize("extra", BAD_RANGES)
def test_single_field_ranges_fail_validation(extra):
    with pytest.raises(msgspec.ValidationError):  # the route turns these into 400 InvalidRequest
        msgspec.convert({"messages": HI, **extra}, chat.ChatRequest)


# --- rendering ------------------------------------------------------------------------------


def test_render_result_is_a_chat_completion_with_logprobs():
    r = req({"messages": HI, "logprobs": True, "top_logprobs": 1, "model": "tiny"})
    tops = [[TopLogprob(5, "é", -0.1)], [TopLogprob(6, "!", -0.5)]]
    choice = Choice(text="é!", token_ids=[5, 6], token_texts=["é", "!"], logprobs=[float("-inf"), -0.5])
    choice.top_logprobs, choice.finish_reason, choice.stop_reason = tops, "stop", "\n"
    usage = Usage(prompt_tokens=4, completion_tokens=2)
    body = chat.render_result(r, JobResult(choices=[choice], usage=usage), "j1", 7)
    e_top, bang = {"token": "é", "logprob": -0.1, "bytes": [195, 169]}, {"token": "!", "logprob": -0.5, "bytes": [33]}
    e_sampled = {"token": "é", "logprob": -9999.0, "bytes": [195, 169]}  # -inf floored, as vLLM
    logprobs = {"content": [{**e_sampled, "top_logprobs": [e_top]}, {**bang, "top_logprobs": [bang]}]}
    message = {"role": "assistant", "content": "é!"}
    # Compared as bytes: key order and nulls are part of the wire shape.
    assert encode(body) == encode({
        "id": "chatcmpl-j1",
        "object": "chat.completion",
        "created": 7,
        "model": "tiny",
        "choices": [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": "stop", "stop_reason": "\n"}
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    })


def test_render_result_without_logprobs_and_without_generation_prompt():
    options = {"add_generation_prompt": False, "continue_final_message": True}
    r = req({"messages": [{"role": "assistant", "content": "Once"}], **options})
    body = chat.render_result(r, JobResult(choices=[Choice(text=" upon", finish_reason="length")]), "j", 1)
    # Without a generation prompt vLLM answers in the last message's role.
    message = {"role": "assistant", "content": " upon"}
    expected = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    assert encode(body.choices) == encode([expected])
    r = req({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False})
    body = chat.render_result(r, JobResult(choices=[Choice(text="y")]), "j", 1)
    assert body.choices[0].message == ChatCompletionMessage(role="user", content="y")


HEAD = b'data: {"id":"chatcmpl-j1","object":"chat.completion.chunk","created":7,"model":"tiny",'


async def test_stream_role_chunk_first_then_deltas_usage_and_done():
    r = req({"messages": HI, "model": "tiny", "stream": True, "stream_options": {"include_usage": True}})
    events = [
        Keepalive(),
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
        Done(
            seq=2,
            deltas=[TokenDelta(token_ids=[2], text="b", finish_reason="stop")],
            usage=Usage(prompt_tokens=3, completion_tokens=2),
        ),
    ]
    assert await frames(r, events) == [
        KEEPALIVE,
        HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"content":"b"},"logprobs":null,"finish_reason":"stop",'
        b'"stop_reason":null}]}\n\n',
        HEAD + b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
        SSE_DONE,
    ]


async def test_stream_opens_every_choice_and_carries_chunk_logprobs():
    r = req({"messages": HI, "model": "tiny", "stream": True, "n": 2, "logprobs": True})
    events = [
        Done(
            seq=1,
            deltas=[
                TokenDelta(
                    index=1, token_ids=[9], text="z", token_texts=["z"], logprobs=[-0.25], finish_reason="length"
                ),
                TokenDelta(index=0, token_ids=[], text="", finish_reason=None),  # nothing new: skipped
            ],
        )
    ]
    out = [msgspec.json.decode(f.removeprefix(b"data: ")) for f in (await frames(r, events))[:-1]]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in out] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "z"}),
    ]
    assert out[2]["choices"][0]["logprobs"] == {
        "content": [{"token": "z", "logprob": -0.25, "bytes": [122], "top_logprobs": []}]
    }


async def test_stream_ends_with_done_after_an_in_band_error():
    r = req({"messages": HI, "model": "tiny", "stream": True})
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
        Error(seq=2, code="generation_failed", message="engine died", status=500),
    ]
    out = await frames(r, events)
    assert out[-2:] == [
        b'data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}\n\n',
        SSE_DONE,
    ]
    assert len(out) == 4


async def test_lmi_json_lines_form_has_no_keepalives_and_no_done():
    r = req({"messages": HI, "model": "tiny", "stream": True})
    events = [
        Keepalive(),
        Done(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", finish_reason="length")]),
    ]
    out = await frames(r, events, sse_format=False)
    assert out == [
        b'{"id":"chatcmpl-j1","object":"chat.completion.chunk","created":7,"model":"tiny","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n',
        b'{"id":"chatcmpl-j1","object":"chat.completion.chunk","created":7,"model":"tiny","choices":[{"index":0,'
        b'"delta":{"content":"a"},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n',
    ]
    error = [Error(seq=1, code="invalid_request", message="bad", status=400)]
    assert await frames(r, error, sse_format=False) == [
        b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}\n'
    ]


def test_errors_use_the_openai_shape():
    status, body = chat.error_body(InvalidRequest("nope", param="n"))
    assert status == 400
    assert encode(body) == b'{"error":{"message":"nope","type":"BadRequestError","param":"n","code":400}}'


# --- service tiers --------------------------------------------------------------------------


@pytest.mark.parametrize(("tier", "reported"), [
    ("flex", "flex"), ("priority", "priority"), ("default", "default"), ("auto", "default"),
])
def test_service_tier_sets_the_priority_level_and_is_reported_back(tier, reported):
    r = req({"messages": HI, "service_tier": tier})
    assert r.output.service_tier == reported
    if tier == "flex":
        assert r.priority == 2  # the lowest level
    elif tier == "priority":
        assert r.priority is not None and r.priority < 0  # ahead of the default (0) in the engine too
    else:
        assert r.priority is None  # unset: the X-LLMQ-Priority header or the default applies


def test_an_explicit_priority_wins_over_the_tier_and_an_unknown_tier_is_refused():
    assert req({"messages": HI, "service_tier": "flex", "priority": 0}).priority == 0
    assert refused({"messages": HI, "service_tier": "scale"}).param == "service_tier"


async def test_a_named_tier_is_in_the_response_and_in_every_chunk():
    r = req({"messages": HI, "model": "tiny", "service_tier": "flex"})
    result = JobResult(choices=[Choice(index=0, text="a", token_ids=[1], finish_reason="stop")],
                       usage=Usage(prompt_tokens=3, completion_tokens=1))
    body = encode(chat.render_result(r, result, "j1", 7))
    assert body.endswith(b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},'
                         b'"service_tier":"flex"}')
    chunks = await frames(r, [Done(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", finish_reason="stop")])])
    head = b'data: {"id":"chatcmpl-j1","object":"chat.completion.chunk","created":7,"model":"tiny",' \
           b'"service_tier":"flex","choices":'
    assert all(c.startswith(head) for c in chunks[:-1]) and chunks[-1] == SSE_DONE
    # No tier named: no field, byte for byte as before.
    assert b"service_tier" not in encode(chat.render_result(req({"messages": HI, "model": "tiny"}), result, "j1", 7))


# --- tools ----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "w",
                                            "parameters": {"type": "object"}, "strict": True}}


def test_tools_choice_and_history_map_to_the_internal_form():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"P\"}"}}]
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "think"},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = req({"messages": messages, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert r.tools == ToolUse(tools=[Tool(name="get_weather", description="w", parameters={"type": "object"},
                                          strict=True)], choice="required", parallel=False)
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city":"P"}')
    assert r.messages[1] == ChatMessage(role="assistant", content="", reasoning="think", tool_calls=[call])
    assert r.messages[2] == ChatMessage(role="tool", content="sunny", tool_call_id="call_1")
    named = req({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": {"name": "get_weather"}}})
    assert (named.tools.choice, named.tools.function, named.tools.parallel) == ("function", "get_weather", True)
    assert req({"messages": HI, "tools": [WEATHER]}).tools.choice == "auto"  # tools without a choice: auto


def test_empty_tools_and_choice_none_are_accepted():
    assert req({"messages": HI, "tools": [], "tool_choice": "none"}).tools is None
    assert req({"messages": HI, "tool_choice": "none"}).tools is None
    assert req({"messages": HI, "tools": [WEATHER], "tool_choice": "none"}).tools.choice == "none"


def test_reasoning_effort_reaches_the_template():
    assert req({"messages": HI, "reasoning_effort": "low"}).chat.template_kwargs == {"reasoning_effort": "low",
                                                                                   "enable_thinking": True}
    assert req({"messages": HI, "reasoning_effort": "none"}).chat.template_kwargs["enable_thinking"] is False


def test_result_with_tool_calls_has_null_content_and_the_calls():
    r = req({"messages": HI, "model": "tiny", "tools": [WEATHER]})
    call = ToolCall(id="call_j_0", name="get_weather", arguments='{"city":"Paris"}')
    result = JobResult(choices=[Choice(text="", reasoning="plan", tool_calls=[call], finish_reason="tool_calls")])
    body = encode(chat.render_result(r, result, "j", 1))
    assert msgspec.json.decode(body)["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": None, "reasoning": "plan", "tool_calls": [
            {"id": "call_j_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]


async def test_stream_tool_call_first_piece_names_it_then_argument_fragments():
    r = req({"messages": HI, "model": "tiny", "stream": True, "tools": [WEATHER]})
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="", reasoning="hmm")]),
        Tokens(seq=2, deltas=[TokenDelta(token_ids=[2], text="")]),  # held back by the parser: nothing sent
        Tokens(seq=3, deltas=[TokenDelta(token_ids=[3], tool_calls=[
            ToolCallDelta(index=0, id="call_j1_0", name="get_weather", arguments="")])]),
        Tokens(seq=4, deltas=[TokenDelta(token_ids=[4], tool_calls=[ToolCallDelta(index=0, arguments='{"city":')])]),
        Done(seq=5, deltas=[TokenDelta(token_ids=[5], tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')],
                                       finish_reason="tool_calls")]),
    ]
    assert await frames(r, events) == [
        HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"reasoning":"hmm"},"logprobs":null,"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_j1_0","type":"function",'
        b'"function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\":"}}]},'
        b'"logprobs":null,"finish_reason":null}]}\n\n',
        HEAD + b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\"Paris\\"}"}}]},'
        b'"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}]}\n\n',
        SSE_DONE,
    ]


async def test_include_reasoning_false_leaves_reasoning_out():
    r = req({"messages": HI, "model": "tiny", "stream": True, "include_reasoning": False})
    out = await frames(r, [Done(seq=1, deltas=[TokenDelta(token_ids=[1], text="", reasoning="secret",
                                                           finish_reason="stop")])])
    assert b"secret" not in b"".join(out)
    result = JobResult(choices=[Choice(text="a", reasoning="secret")])
    assert b"secret" not in encode(chat.render_result(r, result, "j", 1))


async def test_lmi_chat_lines_carry_tool_calls_as_the_sse_chunks_do():
    r = req({"messages": HI, "model": "tiny", "stream": True, "tools": [WEATHER]})
    events = [Done(seq=1, deltas=[TokenDelta(token_ids=[1], tool_calls=[
        ToolCallDelta(index=0, id="call_j1_0", name="get_weather", arguments="{}")], finish_reason="tool_calls")])]
    lines, chunks = await frames(r, events, sse_format=False), await frames(r, events)
    assert [b"data: " + line.rstrip(b"\n") + b"\n\n" for line in lines] == chunks[:-1]  # no [DONE] in JSON lines
    assert b'"tool_calls":[{"index":0,"id":"call_j1_0","type":"function"' in lines[1]
