"""Deterministic, offline builder of a tiny Llama model directory.

Tests and local runs need a real model that vLLM can load, but there is no
network access and real checkpoints are far too slow on CPU. This module
builds a ~1M-parameter ``LlamaForCausalLM`` with random weights and a
byte-level BPE tokenizer trained on a small embedded corpus. Its output is
gibberish, but the whole serving path (tokenizer, chat template, sampling,
logprobs, EOS, streaming) behaves like a real model.

Tool calling and reasoning follow Qwen2.5/Qwen3's hermes format, so vLLM's
own parsers read the tiny model's output as they read a real model's: serve it
with the ``hermes`` tool parser and the ``qwen3`` reasoning parser. Its random
weights never write those tags unprompted: tests script or force them.

The directory's name carries a build version (``TINY_MODEL_DIR`` in
shared/config.py): bump it whenever this module builds anything different, as
``ensure_tiny_model`` keeps any build it finds.

The build is byte-identical across runs (fixed seed, fixed corpus, no
timestamps) and takes a few seconds.

Usage::

    python -m workers.tiny_model [PATH]   # builds PATH (default: the cache) unless it exists;
                                          # the default also builds its LoRA adapters (TINY_ADAPTERS)
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
# The model's width and depth: its adapters (build_tiny_adapter) are shaped by them too.
HIDDEN = 128
LAYERS = 4
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

# Added after training, so every trained token keeps its id (these take 625-630,
# in Qwen2.5/Qwen3's order). Single tokens, as in Qwen: vLLM's reasoning parsers
# look <think> and </think> up in the vocab (deepseek_r1 refuses a tokenizer
# without them; qwen3 makes them and the tool-call tags token-id terminals).
# Not special, as in Qwen: the hermes parser reads tags from the decoded text,
# and a special token vanishes from it under the default skip_special_tokens=True
# (vLLM's parsers turn that off only for requests they parse), so the tags show
# in every output, and no dialect flags them as special.
AGENT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Zephyr-style role markers: plain text keeps the tokenizer simple (no extra
# special tokens), and each turn ends with the EOS token, so a generated "</s>"
# stops generation the way it does with real models. A chat without tools,
# tool calls, reasoning, enable_thinking or reasoning_effort renders (and so
# tokenizes) exactly as the first build's template did. The rest is
# Qwen2.5/Qwen3's hermes format in those markers:
# - `tools`: a system preamble (holding a leading system message) lists them
#   as JSON in <tools></tools> and shows the <tool_call> answer format;
# - an assistant turn's `tool_calls` become <tool_call> blocks, arguments as
#   given (a JSON string) or as JSON (the dict vLLM's _postprocess_messages
#   makes of them; none: {}); its `reasoning` (or `reasoning_content`) goes
#   first, in <think></think> (interleaved thinking: every turn that has it);
# - `tool` results, consecutive ones grouped, become <tool_response> blocks in
#   one user turn; a system message anywhere renders in place;
# - `reasoning_effort` (vLLM passes it on; it also sets enable_thinking to
#   effort != "none") is a line of the system preamble, so it shows in the
#   prompt, and nothing more: random weights cannot think harder;
# - `enable_thinking` false follows the generation prompt with an empty
#   <think></think>, as Qwen3's template does; true opens <think> there, as
#   DeepSeek-R1's and Qwen3-2507's thinking templates do. Unset is thinking on,
#   as vLLM's qwen3 parser reads it: <think> is opened as for true when the
#   prompt holds a <tool_call> or </think> (tools, tool calls or reasoning),
#   while a plain chat renders as before and leaves <think> to the model
#   (Qwen3's convention). The open <think> is what tells vLLM, from the prompt
#   alone, that the answer starts in reasoning: without Qwen's <|im_start|>
#   turn tokens, its backwards scan of the prompt (is_reasoning_end) runs on
#   into those tags, which say reasoning has ended.
CHAT_TEMPLATE = r"""
{%- set preamble = tools or reasoning_effort %}
{%- set merged_system = preamble and messages and messages[0]['role'] == 'system' %}
{%- set seen = namespace(tags=tools) %}
{{- bos_token }}
{%- if preamble %}
    {{- '<|system|>\n' }}
    {%- if merged_system and messages[0]['content'] is string %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {%- if reasoning_effort %}
        {{- 'Reasoning effort: ' + reasoning_effort }}
        {%- if tools %}
            {{- '\n\n' }}
        {%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
        {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
        {%- for tool in tools %}
            {{- '\n' + tool | tojson }}
        {%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- eos_token + '\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message['content'] if message['content'] is string else '' %}
    {%- set reasoning = message['reasoning'] or message['reasoning_content'] %}
    {%- if loop.first and merged_system %}
        {#- in the preamble #}
    {%- elif message['role'] == 'assistant' and (message['tool_calls'] or reasoning) %}
        {%- set seen.tags = true %}
        {{- '<|assistant|>\n' }}
        {%- if reasoning and reasoning is string %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message['tool_calls'] or [] %}
            {%- set call = call['function'] if call['function'] is defined else call %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' }}
            {%- if call['arguments'] is string and call['arguments'] %}
                {{- call['arguments'] }}
            {%- else %}
                {{- (call['arguments'] or {}) | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- eos_token + '\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or loop.previtem['role'] != 'tool' %}
            {{- '<|user|>' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem['role'] != 'tool' %}
            {{- eos_token + '\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|' + message['role'] + '|>\n' + content + eos_token + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
    {%- if enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- elif enable_thinking is true or (enable_thinking is not boolean and seen.tags) %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""

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


def build_tokenizer():
    """Train a byte-level BPE, add :data:`AGENT_TOKENS`, and wrap it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_TOKENS])
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
    tokenizer = build_tokenizer()
    trained = len(tokenizer) - len(AGENT_TOKENS)

    config = LlamaConfig(
        # The trained tokens only, as the first build had: the seed then draws
        # the first build's weights, and the agent tokens' rows come below.
        vocab_size=trained,
        hidden_size=HIDDEN,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention rejects 16
        num_key_value_heads=4,
        num_hidden_layers=LAYERS,
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
    # Grow the (tied) embeddings to the whole tokenizer: ids without a token
    # would break detokenizing, and a token without a row cannot be forced.
    # The trained rows keep their weights; the added ones are zero, so their
    # logit is 0 at every step, below the best trained token's (never under 2.6
    # where measured), and greedy output stays the first build's. Sampling at
    # temperature 1 draws one of them about once in 200 tokens, and logprobs
    # shift by up to ~0.006, as the softmax has six more terms.
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[trained:] = 0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return readable(path)


def readable(path: Path) -> Path:
    """``path`` and its files made readable like any other model directory: save_pretrained writes
    the weights as 0600 (via a temp file), and mkdtemp makes 0700 directories."""
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)
    return path


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def _adapter_built(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()


def _ensure(path: Path, build, is_built) -> Path:
    """``path``, built there by ``build(tmp)`` first if ``is_built`` says it is missing.

    Safe when several processes race: each builds into its own temp dir next
    to the target and renames it into place. A directory rename is atomic and
    fails if the target is a non-empty directory, so exactly one build wins
    and nobody ever sees a half-written directory.
    """
    path = Path(path)
    if is_built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, path)  # also replaces an empty dir at path
        except OSError:
            if not is_built(path):  # lost to something that is not ours
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_tiny_model(path: Path) -> Path:
    """Return ``path``, building the model there first if it is missing."""
    return _ensure(path, build_tiny_model, _is_built)


# The tiny model's attention projections, each HIDDEN x HIDDEN: what its adapters adapt.
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_RANK = 8


def build_tiny_adapter(path: Path, *, seed: int, rank: int = ADAPTER_RANK, base: str = "tiny-llama") -> Path:
    """A random LoRA adapter of the tiny model at ``path``, in PEFT's layout (``adapter_config.json``
    and ``adapter_model.safetensors``), as vLLM loads one. Written by hand, without PEFT: PEFT
    starts B at zero, which adapts nothing, and a test needs an adapter that changes the answer.
    The same ``seed`` builds the same bytes; a different one, a different adapter."""
    import json

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for target in ADAPTER_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            # Scaled so the adapter moves the logits as much as the base weights do (std 0.1).
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=generator) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, rank, generator=generator) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
              "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": list(ADAPTER_TARGETS), "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return readable(path)


def ensure_tiny_adapter(path: Path, *, seed: int) -> Path:
    """Return ``path``, building a tiny adapter of ``seed`` there first if it is missing."""
    return _ensure(path, lambda tmp: build_tiny_adapter(tmp, seed=seed), _adapter_built)


def main() -> None:
    if len(sys.argv) > 2:
        sys.exit("usage: python -m workers.tiny_model [PATH]   (default: the settings' cache path)")
    if len(sys.argv) == 2:
        print(f"tiny model ready at {ensure_tiny_model(Path(sys.argv[1]))}")
        return
    from shared.config import DEFAULT_MODEL, TINY_ADAPTERS, load_settings

    settings = load_settings()
    if settings.model != DEFAULT_MODEL:
        print(f"LLMQ_MODEL is {settings.model!r}: no tiny model needed")
        return
    print(f"tiny model ready at {ensure_tiny_model(Path(settings.model_path))}")
    for name, path in settings.tiny_adapter_dirs.items():
        print(f"tiny adapter {name} ready at {ensure_tiny_adapter(path, seed=TINY_ADAPTERS[name])}")


if __name__ == "__main__":
    main()
