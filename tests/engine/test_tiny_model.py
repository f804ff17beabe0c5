"""The tiny model as built (workers/tiny_model.py): byte-identical builds that keep the first
build's weights, and vLLM's own hermes tool parser and qwen3 reasoning parser reading its
tokenizer and chat template as they read a Qwen model's. The template's strings: tests/unit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from safetensors.torch import load_file
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.renderers.hf import _detect_content_format, resolve_chat_template_kwargs
from vllm.tokenizers import get_tokenizer

from workers.tiny_model import CHAT_TEMPLATE, build_tiny_model

pytestmark = pytest.mark.engine

REASONING_PARSER = "qwen3"  # the one the tiny model is documented with (README, docs/architecture.md)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT, SAID = "plan", "Let me check."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"<think>{THOUGHT}</think>{SAID}{CALL}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return get_tokenizer(str(model_dir))


def test_the_build_is_byte_identical_and_keeps_the_first_builds_weights(model_dir: Path, tmp_path: Path):
    again = build_tiny_model(tmp_path / "again")
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 631
    weights = load_file(model_dir / "model.safetensors")
    embeddings = weights["model.embed_tokens.weight"]  # tied: also the output layer
    assert embeddings.shape == (631, 128) and not embeddings[625:].any(), "the agent tokens' rows are zero"
    # Every tensor of the first build (625 tokens), pinned from it: greedy output stays its own.
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = embeddings[:625] if name == "model.embed_tokens.weight" else weights[name]
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    assert digest.hexdigest() == "1172b5c4d3e9f00cde12c98a5e5498a182316b8427d532f99e1f305076ca7573"


def test_vllm_renders_the_template_with_string_content_and_passes_its_kwargs_on(tok):
    """A template vLLM read as iterating over content would get content parts, which this one
    renders as empty text; kwargs a template does not name are dropped before rendering."""
    assert _detect_content_format(CHAT_TEMPLATE, default="openai") == "string"
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "unknown": 1}
    assert resolve_chat_template_kwargs(tok, CHAT_TEMPLATE, kwargs) == {"enable_thinking": False,
                                                                        "reasoning_effort": "low"}


def parser_class(tok, reasoning_parser: str = REASONING_PARSER):
    """As vLLM's server builds it at start-up, checking it against the tokenizer."""
    return ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name=reasoning_parser,
                                    enable_auto_tools=True, tokenizer=tok)


def chat_request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny-llama", messages=USER, tools=TOOLS, tool_choice="auto", **kwargs)


def parsed(tok, text: str, prompt_ids: list[int], template_kwargs: dict, chunk: int = 0) -> tuple:
    """(reasoning, content, [(name, arguments)]) from a fresh parser per request, as vLLM's chat
    server runs it: ``parse`` of the whole text, or (``chunk`` > 0) ``parse_delta`` fed that many
    tokens at a time, with their text as the detokenizer gives it."""
    req = chat_request(chat_template_kwargs=template_kwargs)
    parser = parser_class(tok)(tok, req.tools, chat_template_kwargs=template_kwargs)
    req = parser.adjust_request(req)
    ids = tok.encode(text, add_special_tokens=False)
    if not chunk:
        reasoning, content, calls = parser.parse(text, req, enable_auto_tools=True, model_output_token_ids=ids)
        return reasoning, content, [(c.name, c.arguments) for c in calls or []]
    reasoning, content, names, arguments = "", "", {}, {}
    for start in range(0, len(ids), chunk):
        delta_ids = ids[start:start + chunk]
        delta = tok.decode(ids[:start + chunk])[len(tok.decode(ids[:start])):]
        message = parser.parse_delta(delta, delta_ids, req, prompt_token_ids=prompt_ids,
                                     finished=start + chunk >= len(ids))
        if message is None:
            continue
        reasoning += message.reasoning or ""
        content += message.content or ""
        for call in message.tool_calls:
            names[call.index] = names.get(call.index, "") + (call.function.name or "")
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return reasoning or None, content or None, [(names[i], arguments[i]) for i in sorted(names)]


def test_vllm_builds_its_parsers_on_the_tiny_tokenizer(tok):
    """get_parser constructs the parser on the tokenizer: a reasoning parser whose think tokens are
    missing from the vocab refuses it (deepseek_r1 raises, qwen3 would match text only)."""
    for reasoning_parser in (REASONING_PARSER, "deepseek_r1"):
        parser = parser_class(tok, reasoning_parser)(tok, chat_request().tools)
        assert parser.tool_parser is not None and parser.reasoning_parser is not None
    assert parser.reasoning_parser.start_token_id == 629 and parser.reasoning_parser.end_token_id == 630


@pytest.mark.parametrize("chunk", [0, 1, 3], ids=["parse", "parse_delta by token", "parse_delta by 3 tokens"])
def test_the_parsers_split_reasoning_content_and_a_tool_call(tok, chunk):
    prompt_ids = tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert parsed(tok, SCRIPT, prompt_ids, {}, chunk) == (THOUGHT, SAID, [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize(("history", "tools", "kwargs", "reasoning_open", "output"), [
    # The model opens <think> itself: a plain chat, thinking unset (Qwen3's convention).
    (USER, None, {}, True, SCRIPT),
    # The template opened it: the model writes on from inside.
    (USER, None, {"enable_thinking": True}, True, f"{THOUGHT}</think>{SAID}{CALL}"),
    (USER, TOOLS, {}, True, f"{THOUGHT}</think>{SAID}{CALL}"),
    (USER + [{"role": "assistant", "content": "ok", "reasoning": "earlier"}, *USER], None, {}, True,
     f"{THOUGHT}</think>{SAID}{CALL}"),
    # Thinking off: the template closed an empty block.
    (USER, TOOLS, {"enable_thinking": False}, False, f"{SAID}{CALL}"),
], ids=["plain chat, unset", "plain chat, on", "tools, unset", "reasoning in the history, unset", "tools, off"])
def test_the_prompt_tells_vllm_whether_the_answer_starts_in_reasoning(tok, history, tools, kwargs, reasoning_open,
                                                                       output):
    """``is_reasoning_end`` of the rendered prompt (the engine's grammar gate, and where
    ``parse_delta`` starts) agrees with the template and the parser's own reading of
    enable_thinking, so streamed and whole-text parsing give the same answer."""
    prompt_ids = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, return_dict=False,
                                         **kwargs)
    parser = parser_class(tok)(tok, chat_request().tools, chat_template_kwargs=kwargs)
    assert parser.is_reasoning_end(prompt_ids) is not reasoning_open
    expected = (THOUGHT if reasoning_open else None, SAID, [("get_weather", '{"city": "Paris"}')])
    assert parsed(tok, output, prompt_ids, kwargs) == parsed(tok, output, prompt_ids, kwargs, chunk=1) == expected
