"""The tiny model's tokenizer and chat template (workers/tiny_model.py), as saved and loaded back:
the hermes/Qwen format its tool calling and reasoning follow, and plain chats as the first build
rendered them. The model itself, and vLLM's parsers on it: tests/engine/test_tiny_model.py."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from workers.tiny_model import AGENT_TOKENS, build_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]


def call(arguments: object, name: str = "get_weather") -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    """Saved and loaded back, as the API and vLLM load it from the model directory."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def render(tok, messages: list[dict], **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_a_plain_chat_renders_and_tokenizes_as_the_first_build_did(tok):
    """Pinned from the first build (no agent tokens): its prompts, and so prompt token counts,
    are unchanged, also with the kwargs vLLM always passes (tools and reasoning_effort None)."""
    first_build = ("<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
                   "<|user|>\nWeather in Paris?</s>\n<|assistant|>\n")
    assert render(tok, PLAIN) == render(tok, PLAIN, tools=None, reasoning_effort=None) == first_build
    assert tok.apply_chat_template(PLAIN, tokenize=False) == first_build.removesuffix("<|assistant|>\n")
    assert tok.apply_chat_template(PLAIN, add_generation_prompt=True)["input_ids"] == [
        1, 31, 95, 448, 86, 87, 72, 80, 95, 33, 202, 37, 72, 292, 85, 76, 403, 17, 2, 202, 31, 95, 88, 86, 266, 95,
        33, 202, 43, 76, 2, 202, 31, 95, 68, 86, 449, 511, 95, 33, 202, 43, 275, 79, 82, 4, 2, 202, 31, 95, 88, 86,
        266, 95, 33, 202, 58, 72, 296, 261, 85, 314, 586, 34, 2, 202, 31, 95, 68, 86, 449, 511, 95, 33, 202]


def test_the_agent_tokens_are_single_added_tokens_after_the_trained_vocab_and_not_special(tok):
    assert [tok.convert_tokens_to_ids(t) for t in AGENT_TOKENS] == list(range(625, 631)) and len(tok) == 631
    assert AGENT_TOKENS == ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    assert not set(range(625, 631)) & set(tok.all_special_ids)
    text = '<think>plan</think>ok<tool_call>\n{"a": 1}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    for t in AGENT_TOKENS[:2] + AGENT_TOKENS[4:]:
        assert ids.count(tok.convert_tokens_to_ids(t)) == 1, t
    # Not special: the tags stay in the text whatever skip_special_tokens says; </s> still goes.
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False) == text + "</s>"
    assert [tok.decode([i]) for i in range(625, 631)] == AGENT_TOKENS


def test_tools_make_a_system_preamble_that_holds_a_leading_system_message(tok):
    assert render(tok, PLAIN[:2], tools=TOOLS) == (
        f"<s><|system|>\nBe brief.\n\n{PREAMBLE}</s>\n<|user|>\nHi</s>\n<|assistant|>\n<think>\n")
    assert render(tok, PLAIN[1:2], tools=TOOLS, enable_thinking=False) == (
        f"<s><|system|>\n{PREAMBLE}</s>\n<|user|>\nHi</s>\n<|assistant|>\n<think>\n\n</think>\n\n")


def test_assistant_tool_calls_render_the_same_from_dict_and_string_arguments(tok):
    as_dict = [PLAIN[1], {"role": "assistant", "content": None, "tool_calls": [call({"city": "Paris"})]}]
    as_string = [PLAIN[1], {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]}]
    expected = ('<s><|user|>\nHi</s>\n<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call></s>\n')
    assert tok.apply_chat_template(as_dict, tokenize=False) == tok.apply_chat_template(as_string, tokenize=False)
    assert tok.apply_chat_template(as_dict, tokenize=False) == expected
    # Content first, then each call on its own line; arguments of none render as {}.
    two = [{"role": "assistant", "content": "Checking.", "tool_calls": [call({"city": "Paris"}), call(None, "now")]}]
    assert tok.apply_chat_template(two, tokenize=False) == (
        '<s><|assistant|>\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call></s>\n')


def test_tool_results_render_as_tool_responses_in_one_user_turn_per_run(tok):
    messages = [{"role": "assistant", "content": "", "tool_calls": [call({"city": "Paris"}), call({"city": "Lyon"})]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
                {"role": "assistant", "content": "", "tool_calls": [call({"city": "Nice"})]},
                {"role": "tool", "tool_call_id": "call_3", "content": "22C"}]
    calls = [f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
             for c in ("Paris", "Lyon", "Nice")]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        f"<s><|assistant|>\n{calls[0]}\n{calls[1]}</s>\n"
        "<|user|>\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n</tool_response></s>\n"
        f"<|assistant|>\n{calls[2]}</s>\n"
        "<|user|>\n<tool_response>\n22C\n</tool_response></s>\n")


def test_assistant_reasoning_renders_in_think_before_the_content_in_every_turn(tok):
    messages = [PLAIN[1], {"role": "assistant", "content": "Hello!", "reasoning": "\nGreet back.\n"},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
                 "tool_calls": [call({"city": "Paris"})]}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<s><|user|>\nHi</s>\n<|assistant|>\n<think>\nGreet back.\n</think>\n\nHello!</s>\n<|user|>\nWeather?</s>\n"
        '<|assistant|>\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call></s>\n')


def test_system_messages_anywhere_render_in_place(tok):
    messages = [PLAIN[1], {"role": "system", "content": "Mid-list."}, {"role": "assistant", "content": "Ok"},
                {"role": "system", "content": "Last."}]
    expected = "<s><|user|>\nHi</s>\n<|system|>\nMid-list.</s>\n<|assistant|>\nOk</s>\n<|system|>\nLast.</s>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    # With tools only a leading system message joins the preamble.
    assert tok.apply_chat_template(messages, tools=TOOLS, tokenize=False) == (
        f"<s><|system|>\n{PREAMBLE}</s>\n" + expected.removeprefix("<s>"))


@pytest.mark.parametrize(("messages", "tools", "kwargs", "after"), [
    # a plain chat leaves <think> to the model unless asked
    (PLAIN, None, {}, ""),
    (PLAIN, None, {"enable_thinking": True}, "<think>\n"),
    (PLAIN, None, {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    # tools, or tool calls or reasoning in the history, open it unless thinking is off
    (PLAIN, TOOLS, {}, "<think>\n"),
    (PLAIN, TOOLS, {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    (PLAIN[:2] + [{"role": "assistant", "content": "x", "reasoning": "y"}], None, {}, "<think>\n"),
    (PLAIN[:2] + [{"role": "assistant", "tool_calls": [call({})]}], None, {}, "<think>\n"),
    (PLAIN[:2] + [{"role": "assistant", "tool_calls": [call({})]}], None, {"enable_thinking": None}, "<think>\n"),
], ids=["plain, unset", "plain, on", "plain, off", "tools, unset", "tools, off", "reasoning in the history, unset",
        "tool calls in the history, unset", "tool calls in the history, none"])
def test_enable_thinking_follows_the_generation_prompt(tok, messages, tools, kwargs, after):
    without = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert render(tok, messages, tools=tools, **kwargs) == without + "<|assistant|>\n" + after


def test_reasoning_effort_is_a_line_of_the_system_preamble(tok):
    assert render(tok, PLAIN[:2], reasoning_effort="high") == (
        "<s><|system|>\nBe brief.\n\nReasoning effort: high</s>\n<|user|>\nHi</s>\n<|assistant|>\n")
    assert render(tok, PLAIN[1:2], tools=TOOLS, reasoning_effort="low", enable_thinking=True) == (
        f"<s><|system|>\nReasoning effort: low\n\n{PREAMBLE}</s>\n<|user|>\nHi</s>\n<|assistant|>\n<think>\n")
