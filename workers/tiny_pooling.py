"""Deterministic, offline builders of the two tiny pooling models: ``tiny-embed`` and ``tiny-rerank``.

The retrieval twins of workers/tiny_model.py's tiny-llama: tests and local runs need an embedding
model and a cross-encoder that vLLM's pooling runner loads on CPU, without network access. Both
use tiny-llama's tokenizer (a byte-level BPE: any unicode text encodes), and random weights: the
vectors and scores mean nothing, but the whole path (tokenizing, the pooler, normalising,
truncating, a pair's token types) is a real model's.

- ``tiny-embed``: a Llama of hidden 64, 2 layers and 2 heads (head_dim 32: vLLM's CPU attention
  refuses 16), served with ``runner="pooling", convert="embed"``: the last token's hidden state,
  normalised, 64 floats. Its config names Matryoshka dimensions (16, 32, 64), so OpenAI's
  ``dimensions`` is taken, as for a model trained that way: vLLM truncates, then normalises.
- ``tiny-rerank``: a ``BertForSequenceClassification`` of one label (a cross-encoder), hidden 64,
  2 layers and 2 heads, 2,048 positions. Its tokenizer frames a pair as ``<s> query </s> document
  </s>``, the document's tokens of type 1, as BERT's ``[CLS] a [SEP] b [SEP]`` does; vLLM's
  ``LLM.score`` reads the one logit through a sigmoid. ``initializer_range`` 0.5 spreads the
  scores, so that a ranking of random weights is not a tie.

Each directory's name carries its build version (``TINY_POOLING_DIRS`` in shared/config.py): bump
it whenever this module builds anything different. The builds are byte-identical across runs
(fixed seed and tokenizer, no timestamps) and take a few seconds.

Usage::

    python -m workers.tiny_pooling embed|rerank [PATH]   # builds PATH (default: its cache directory)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from workers.tiny_model import SEED, _ensure, build_tokenizer, readable

__all__ = ["build_tiny_embed", "build_tiny_rerank", "ensure_tiny_embed", "ensure_tiny_rerank", "ensure_tiny_pooling"]

HIDDEN = 64
HEADS = 2
LAYERS = 2
MATRYOSHKA = [16, 32, 64]
RERANK_POSITIONS = 2048  # LLMQ_MAX_MODEL_LEN's default fits (BERT's positions are learned: not extended)


def build_tiny_embed(path: Path) -> Path:
    """Build the embedding model's directory at ``path`` (created or overwritten in place)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        num_hidden_layers=LAYERS, intermediate_size=4 * HIDDEN,
        max_position_embeddings=2048,  # extended to LLMQ_MAX_MODEL_LEN by Settings.hf_overrides
        tie_word_embeddings=True,  # no separate head: the pooler reads the hidden states
        initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(path)
    tokenizer.chat_template = None  # an embedder embeds text as given
    tokenizer.save_pretrained(path)
    _amend_config(path, matryoshka_dimensions=MATRYOSHKA)
    return readable(path)


def build_tiny_rerank(path: Path) -> Path:
    """Build the cross-encoder's directory at ``path`` (created or overwritten in place)."""
    import torch
    from tokenizers import processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = build_tokenizer().backend_tokenizer
    bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    # BERT's pair framing in tiny-llama's own tokens, the second text of type 1, and the token types
    # among the tokenizer's outputs (vLLM reads them for a cross-encoder's pair).
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", bos), ("</s>", eos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=RERANK_POSITIONS,
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=RERANK_POSITIONS, type_vocab_size=2,
        num_labels=1, initializer_range=0.5, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(SEED)
    BertForSequenceClassification(config).to(torch.float32).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return readable(path)


def _amend_config(path: Path, **fields: object) -> None:
    """Add ``fields`` to the saved config.json (what transformers' config class does not carry)."""
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **fields}, indent=2, sort_keys=True) + "\n")


def _is_built(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "tokenizer.json", "model.safetensors"))


def ensure_tiny_embed(path: Path) -> Path:
    """Return ``path``, building the embedding model there first if it is missing."""
    return _ensure(path, build_tiny_embed, _is_built)


def ensure_tiny_rerank(path: Path) -> Path:
    """Return ``path``, building the cross-encoder there first if it is missing."""
    return _ensure(path, build_tiny_rerank, _is_built)


def ensure_tiny_pooling(model: str, path: Path) -> Path:
    """Return ``path``, building the tiny pooling ``model`` (tiny-embed, tiny-rerank) there first if it is missing."""
    from shared.config import EMBED_MODEL

    return (ensure_tiny_embed if model == EMBED_MODEL else ensure_tiny_rerank)(path)


def main() -> None:
    ensure = {"embed": ensure_tiny_embed, "rerank": ensure_tiny_rerank}
    if not 2 <= len(sys.argv) <= 3 or sys.argv[1] not in ensure:
        sys.exit("usage: python -m workers.tiny_pooling embed|rerank [PATH]   (default: its cache directory)")
    if len(sys.argv) == 3:
        path = Path(sys.argv[2])
    else:
        from shared.config import EMBED_MODEL, RERANK_MODEL, load_settings

        # Its cache directory whatever LLMQ_MODEL says: this command is asked for this model.
        path = Path(load_settings(model=EMBED_MODEL if sys.argv[1] == "embed" else RERANK_MODEL).model_path)
    print(f"tiny-{sys.argv[1]} ready at {ensure[sys.argv[1]](path)}")


if __name__ == "__main__":
    main()
