"""The engine a worker builds, and the same engine as ``vllm serve`` flags (the benchmark's peer)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from shared.config import load_settings
from tests.bench.serving import vllm_server_args
from workers.engine import engine_args

pytestmark = pytest.mark.engine


def _served(flags: list[str]) -> AsyncEngineArgs:
    """``vllm serve``'s engine flags read by vLLM's own parser (the server's front-end flags dropped)."""
    engine_flags = flags[flags.index("--model"):]
    front_end = (("--host", True), ("--port", True), ("--disable-uvicorn-access-log", False),
                 ("--enable-auto-tool-choice", False), ("--tool-call-parser", True), ("--tool-strict-level", True))
    for flag, takes_value in front_end:
        if flag in engine_flags:
            i = engine_flags.index(flag)
            del engine_flags[i:i + 1 + takes_value]
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(engine_flags))


def test_the_stream_interval_reaches_the_engine_and_vllm_serve_alike():
    for interval in (1, 4):
        settings = load_settings({"LLMQ_STREAM_INTERVAL": str(interval)})
        ours = engine_args(settings, settings.model_path)
        theirs = _served(vllm_server_args(settings, 8000))
        assert ours.stream_interval == theirs.stream_interval == interval
        for field in ("max_model_len", "max_num_seqs", "enforce_eager", "scheduling_policy", "kv_cache_memory_bytes"):
            assert getattr(ours, field) == getattr(theirs, field), field


def test_lora_settings_reach_the_engine_and_vllm_serve_alike():
    off = load_settings({})
    assert not engine_args(off, off.model_path).enable_lora and not _served(vllm_server_args(off, 8000)).enable_lora
    settings = load_settings({"LLMQ_MAX_LORAS": "3", "LLMQ_MAX_LORA_RANK": "8", "LLMQ_MAX_CPU_LORAS": "5"})
    ours, theirs = engine_args(settings, settings.model_path), _served(vllm_server_args(settings, 8000))
    for field, value in (("enable_lora", True), ("max_loras", 3), ("max_lora_rank", 8), ("max_cpu_loras", 5)):
        assert getattr(ours, field) == getattr(theirs, field) == value, field


def test_a_context_past_the_models_own_is_refused_in_one_line_naming_llmqs_fixes(monkeypatch):
    from shared.config import SettingsError
    from workers.engine import VllmEngine
    from workers.tiny_model import ensure_tiny_model

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    # The tiny model's directory named as a path: served as any model is, its positions not extended.
    tiny = load_settings({}).model_path
    ensure_tiny_model(tiny)
    settings = load_settings({"LLMQ_MAX_MODEL_LEN": "65536", "LLMQ_MODEL": tiny})
    with pytest.raises(SettingsError) as refused:  # from vLLM's config, before any weight is loaded
        VllmEngine.build(settings, settings.model_path)
    assert str(refused.value) == (
        "LLMQ_MAX_MODEL_LEN=65536 is longer than this model's context (max_position_embeddings=2048): set "
        "LLMQ_MAX_MODEL_LEN=2048 or less, or LLMQ_ALLOW_LONG_CONTEXT=true to run past it (output past the "
        "model's trained positions is garbage)")


def test_the_tiny_model_takes_any_context_without_the_allowance(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    settings = load_settings({"LLMQ_MAX_MODEL_LEN": "65536"})
    config = engine_args(settings, settings.model_path).create_engine_config()
    assert config.model_config.max_model_len == 65536
    assert config.model_config.hf_text_config.max_position_embeddings == 65536  # RoPE tables for every position
    assert load_settings({"LLMQ_MODEL": "/models/llama"}).hf_overrides == {}  # a real model's stay its own
    assert _served(vllm_server_args(settings, 8000)).hf_overrides == settings.hf_overrides  # vllm serve too


def test_the_engine_clamps_max_tokens_to_the_room_its_prompt_leaves():
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TextPrompt, TokensPrompt

    from shared.schemas import GenerationRequest, SamplingParams
    from workers.engine import VllmEngine, to_sampling_params

    engine = SimpleNamespace(max_model_len=2048)  # _budget reads nothing else of the engine
    req = GenerationRequest(prompt_token_ids=[5] * 2000, sampling=SamplingParams(max_tokens=32000))
    budget = VllmEngine._budget(engine, req, TokensPrompt(prompt_token_ids=[5] * 2000))
    assert budget == 48 and to_sampling_params(req, max_tokens=budget).max_tokens == 48
    # A text prompt is tokenised inside vLLM: counted as one token, the engine stops at the context's end.
    assert VllmEngine._budget(engine, req, TextPrompt(prompt="hi")) == 2047
    # min_tokens past the clamped budget is vLLM's own refusal, as on its server (the worker: InvalidRequest).
    tight = GenerationRequest(prompt_token_ids=[5] * 2000, sampling=SamplingParams(max_tokens=32000, min_tokens=100))
    budget = VllmEngine._budget(engine, tight, TokensPrompt(prompt_token_ids=[5] * 2000))
    with pytest.raises(VLLMValidationError, match="min_tokens must be less than or equal to max_tokens=48"):
        to_sampling_params(tight, max_tokens=budget)
