"""Deterministic, offline builder of a tiny Llama model directory.

Tests and local runs need a real model that vLLM can load, but there is no
network access and real checkpoints are far too slow on CPU. This module
builds a ~1M-parameter ``LlamaForCausalLM`` with random weights and a
byte-level BPE tokenizer trained on a small embedded corpus. Its output is
gibberish, but the whole serving path (tokenizer, chat template, sampling,
logprobs, EOS, streaming) behaves like a real model.

The build is byte-identical across runs (fixed seed, fixed corpus, no
timestamps) and takes a few seconds.

Usage::

    python -m workers.tiny_model [PATH]   # builds PATH (default: the cache) unless it exists
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 1234
# Upper bound only: the small corpus runs out of merges at ~625 tokens.
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

# Zephyr-style template: plain-text role markers keep the tokenizer simple
# (no extra special tokens), and the assistant turn ends with the EOS token,
# so a generated "</s>" stops generation the way it does with real models.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer. Its only job is to produce a stable set of
# English-ish merges, so a few paragraphs repeated are enough.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A queue holds jobs until a worker
is free to run them. Each worker pulls a request, runs the model, and streams
tokens back to the client as soon as they are ready.
Large language models predict the next token given the tokens before it. The
prompt is split into tokens, the model computes logits, and a sampler picks
the next token. Greedy decoding always picks the most likely token, while
temperature sampling draws from the softened distribution.
User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower,
the Louvre museum, and its cafes along the river Seine.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2048 appear in text, as do
symbols such as {"key": "value"}, [1, 2, 3], (a + b) * c, and path/to/file.py.
Please summarize the following document in three sentences. Thank you!
"""


def _train_tokenizer():
    """Train a byte-level BPE and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level pre-tokenization means any input string is encodable, so
    # tests can send arbitrary unicode without hitting <unk>.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0..3 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    # Prepend BOS like Llama tokenizers do when add_special_tokens=True.
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(path: Path) -> Path:
    """Build the model directory at ``path`` (created or overwritten in place)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()

    config = LlamaConfig(
        # Match the tokenizer exactly: ids without a token would break detokenizing.
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention rejects 16
        num_key_value_heads=4,
        num_hidden_layers=4,
        intermediate_size=384,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        # With the default 0.02 the logits are nearly flat and greedy decoding
        # repeats one token forever; 0.1 gives varied output that can hit EOS.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # float32: this CPU has no native bf16, and the model is tiny anyway.
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # save_pretrained writes the weights as 0600 (via a temp file) and mkdtemp
    # makes 0700 dirs; make the result readable like any other model dir.
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)
    return path


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def ensure_tiny_model(path: Path) -> Path:
    """Return ``path``, building the model there first if it is missing.

    Safe when several processes race: each builds into its own temp dir next
    to the target and renames it into place. A directory rename is atomic and
    fails if the target is a non-empty directory, so exactly one build wins
    and nobody ever sees a half-written model.
    """
    path = Path(path)
    if _is_built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        build_tiny_model(tmp)
        try:
            os.rename(tmp, path)  # also replaces an empty dir at path
        except OSError:
            if not _is_built(path):  # lost to something that is not our model
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main() -> None:
    if len(sys.argv) > 2:
        sys.exit("usage: python -m workers.tiny_model [PATH]   (default: the settings' cache path)")
    if len(sys.argv) == 2:
        path = Path(sys.argv[1])
    else:
        from shared.config import DEFAULT_MODEL, load_settings

        settings = load_settings()
        if settings.model != DEFAULT_MODEL:
            print(f"LLMQ_MODEL is {settings.model!r}: no tiny model needed")
            return
        path = Path(settings.model_path)
    print(f"tiny model ready at {ensure_tiny_model(path)}")


if __name__ == "__main__":
    main()
