"""tiny-vision (workers/tiny_vision.py) served by real vLLM, images fed as llmq's worker feeds them:
the chat rendered to token ids by its own template (shared/chat_template.py, one ``<image>`` per
image), the images beside them, each named by its SHA-256 (vLLM's ``multi_modal_uuids``: its
processor cache and prefix cache key an image by it, so it is hashed once, by the API). One engine,
built as a worker builds it (workers/engine.py). The template and the build: tests/unit."""

from __future__ import annotations

import hashlib
import io
import os
import random
import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from PIL import Image as PILImage
from vllm.renderers.hf import _detect_content_format

from shared.chat_template import chat_token_ids
from shared.config import VISION_MODEL, load_settings
from shared.schemas import ChatMessage, ChatOptions, Image, Text
from workers.environment import apply_engine_environment
from workers.tiny_vision import CHAT_TEMPLATE, build_tiny_vision
from workers.vision import image_cost

# vLLM 0.32's shutdown leaves its zmq context to the collector, which may run in any later test.
pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")]

# (width, height): tiles of 2 × 2 (a 64×48 image, and a 20×20 one resized up to 64×64), 2 × 1 and 1 × 2.
SIZES = [(64, 48), (20, 20), (100, 30), (30, 100)]


def png(width: int, height: int, seed: int) -> bytes:
    """A noise image as a client sends it: PNG bytes (the API stores them under their SHA-256)."""
    img = PILImage.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def test_vllm_reads_the_template_as_taking_content_parts():
    """So `vllm serve` passes an image part as {"type": "image"} too, as llmq's worker does."""
    assert _detect_content_format(CHAT_TEMPLATE, default="string") == "openai"


async def test_vllm_expands_each_image_placeholder_of_rendered_ids_by_image_cost(tmp_path: Path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.engine import VllmEngine

    model_dir = str(build_tiny_vision(tmp_path / "tiny-vision"))
    settings = load_settings({"LLMQ_MODEL": VISION_MODEL, "LLMQ_MAX_MODEL_LEN": "2048",
                              "LLMQ_ENGINE_FRONT": "asyncllm"})  # driven through AsyncLLM itself
    with pytest.MonkeyPatch.context() as env:
        environ = dict(os.environ)
        apply_engine_environment(settings, environ)
        for name, value in environ.items():
            env.setenv(name, value)
        engine = VllmEngine.build(settings, model_dir)
    llm, tokenizer, cost = engine.engine.llm, engine.tokenizer, image_cost(model_dir)
    assert cost is not None
    placeholder = tokenizer.convert_tokens_to_ids("<image>")
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    block_size = llm.vllm_config.cache_config.block_size
    count = 0

    async def run(width: int, height: int, seed: int, after: str = ""):
        nonlocal count
        data = png(width, height, seed)
        sha = hashlib.sha256(data).hexdigest()
        parts = [Text(text="What is in this picture? "), Image(sha256=sha, format="png", width=width, height=height)]
        messages = [ChatMessage(role="user", parts=[*parts, *([Text(text=after)] if after else [])])]
        ids = chat_token_ids(tokenizer, messages, ChatOptions())
        assert ids.count(placeholder) == 1
        prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [PILImage.open(io.BytesIO(data))]},
                              multi_modal_uuids={"image": [sha]})
        count += 1
        final = None
        async for out in llm.generate(prompt, greedy, request_id=f"r{count}"):
            final = out
        assert final is not None and final.finished
        return ids, final

    try:
        for width, height in SIZES:
            ids, out = await run(width, height, seed=1)
            print(f"{width}x{height}: template {len(ids)} tokens, prompt {len(out.prompt_token_ids)}, "
                  f"image {cost.tokens(width, height)}, output {out.outputs[0].token_ids}")
            assert len(out.prompt_token_ids) == len(ids) - 1 + cost.tokens(width, height)
        # The same image again under the same uuid, text after it filling the image's KV block: the
        # prefix cache holds that block (its key is the image's uuid), not only the text before it.
        after = "Please summarize the following document in three sentences. " * (block_size // 8)
        ids, first = await run(*SIZES[0], seed=1, after=after)
        _, again = await run(*SIZES[0], seed=1, after=after)
        assert again.prompt_token_ids == first.prompt_token_ids
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        # Another image of the same size: the same prompt ids, but a block of its own (the cache
        # reaches only up to it) and other pixels reaching the model.
        _, other = await run(*SIZES[0], seed=2, after=after)
        start = ids.index(placeholder)  # where the image's tokens start, in the expanded prompt too
        print(f"block {block_size}, image at {start}: cached {again.num_cached_tokens} of "
              f"{len(again.prompt_token_ids)} again, {other.num_cached_tokens} for another image")
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.num_cached_tokens <= start < start + cost.tokens(*SIZES[0]) <= again.num_cached_tokens
        assert other.outputs[0].token_ids != first.outputs[0].token_ids
    finally:
        llm = tokenizer = None  # the engine's last references go with shutdown()
        with warnings.catch_warnings():
            # vLLM 0.32's shutdown leaves its zmq context to the collector, which warns.
            warnings.filterwarnings("ignore", "Unclosed context", ResourceWarning)
            engine.shutdown()
