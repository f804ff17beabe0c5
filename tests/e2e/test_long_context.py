"""Long contexts on real vLLM with the tiny model: what agent clients (Claude Code: 4k-13k token
prompts, ``max_tokens: 32000``) depend on.

- A context past the tiny model's 2048 positions needs nothing hidden: ``LLMQ_MAX_MODEL_LEN=4096``
  alone serves it, with real logprobs past position 2048 (its positions are extended).
- ``max_tokens`` far past the context runs to the context's end (finish ``length``) instead of a
  400; a prompt that does not fit is the dialect's 400.
- Without ``LLMQ_ALLOW_LONG_CONTEXT``, a worker whose context is longer than its model's stops at
  start, exit code 1, with one log line naming the fixes.
- With it, a model run past its positions computes NaN logits: every logprob is sent as -9999.0,
  and the answer is a 200.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import REPO
from tests.support.real_processes import one_worker

pytestmark = pytest.mark.e2e

CONTEXT = 4096  # twice the tiny model's max_position_embeddings
LONG = [{"role": "user", "content": "x" * 3500}]  # 3520 tokens with the chat template: 576 left
TOO_LONG = [{"role": "user", "content": "x" * 5000}]  # 5020 tokens
CLAUDE_CODE_MAX_TOKENS = 32000
FLOOR = -9999.0


def tiny_model_dir() -> str:
    from shared.config import load_settings
    from workers.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(Path(load_settings({}).model_path)))


def _env(redis_url: str, **settings: str) -> dict[str, str]:
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": f"long-{uuid.uuid4().hex[:6]}",
           "LLMQ_LOG_JSON": "true", "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_HEARTBEAT_S": "1", **settings}
    env.pop("VLLM_ALLOW_LONG_MAX_MODEL_LEN", None)  # nothing hidden: only llmq's settings decide
    return env


def _serve(redis_url: str, logs: Path, **settings: str) -> Iterator[str]:
    """One worker and one API on a queue of their own; yields the API's URL."""
    with one_worker(_env(redis_url, **settings), logs) as url:
        yield url


@pytest.fixture(scope="module")
def long_url(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny model at twice its own context, from LLMQ_MAX_MODEL_LEN alone."""
    yield from _serve(redis_url, tmp_path_factory.mktemp("long-context"), LLMQ_MAX_MODEL_LEN=str(CONTEXT))


@pytest.fixture(scope="module")
def past_positions_url(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny model's directory served as any other model, allowed past its positions."""
    yield from _serve(redis_url, tmp_path_factory.mktemp("past-positions"), LLMQ_MODEL=tiny_model_dir(),
                      LLMQ_MAX_MODEL_LEN=str(CONTEXT), LLMQ_ALLOW_LONG_CONTEXT="true", LLMQ_KV_CACHE_GIB="0.25")


@pytest.fixture(scope="module")
def oai(long_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{long_url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def claude(long_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=long_url, api_key="x", max_retries=0, timeout=300) as client:
        yield client


def test_a_context_longer_than_the_models_stops_the_worker_at_start_with_one_line(redis_url, tmp_path):
    env = _env(redis_url, LLMQ_MODEL=tiny_model_dir(), LLMQ_MAX_MODEL_LEN="65536",
               LLMQ_DEVICE_LOCK_DIR=str(tmp_path / "locks"))
    done = subprocess.run([sys.executable, "-m", "workers"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    errors = [line for line in lines if line["level"] == "error"]
    assert errors == [{"event": "engine_settings_invalid", "level": "error", "timestamp": errors[0]["timestamp"],
                       "error": "LLMQ_MAX_MODEL_LEN=65536 is longer than this model's context "
                                "(max_position_embeddings=2048): set LLMQ_MAX_MODEL_LEN=2048 or less, or "
                                "LLMQ_ALLOW_LONG_CONTEXT=true to run past it (output past the model's trained "
                                "positions is garbage)"}]
    assert lines[-1] == errors[0]  # the last word: nothing after it but the exit


def test_models_advertise_the_context_the_worker_serves(oai):
    assert [m.model_extra["max_model_len"] for m in oai.models.list().data] == [CONTEXT]


def test_chat_max_tokens_past_the_context_runs_to_its_end_with_real_logprobs(oai):
    resp = oai.chat.completions.create(model="tiny-llama", messages=LONG, max_tokens=CLAUDE_CODE_MAX_TOKENS,
                                       temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (3520, CONTEXT)
    # Every position past the model's 2048 has a real logprob (no NaN: the positions are extended).
    lps = [c.logprob for c in resp.choices[0].logprobs.content]
    assert len(lps) == CONTEXT - 3520 and all(-50 < lp <= 0 for lp in lps)


def test_claude_codes_max_tokens_runs_to_the_contexts_end(claude):
    msg = claude.messages.create(model="tiny-llama", messages=LONG, max_tokens=CLAUDE_CODE_MAX_TOKENS,
                                 extra_body={"temperature": 0})
    assert msg.stop_reason == "max_tokens"  # the greedy text never ends: the context does
    assert (msg.usage.input_tokens, msg.usage.input_tokens + msg.usage.output_tokens) == (3520, CONTEXT)


def test_a_prompt_that_does_not_fit_is_each_dialects_400(oai, claude, long_url):
    message = ("This model's maximum context length is 4096 tokens. However, your prompt contains 5020 input tokens, "
               "which exceeds this limit even without any output tokens.")
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model="tiny-llama", messages=TOO_LONG, max_tokens=CLAUDE_CODE_MAX_TOKENS)
    assert message in chat.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="tiny-llama", messages=TOO_LONG, max_tokens=CLAUDE_CODE_MAX_TOKENS)
    assert messages.value.body["error"]["type"] == "invalid_request_error"
    assert message in messages.value.body["error"]["message"]
    tgi = httpx.post(f"{long_url}/generate", json={"inputs": "x" * 5000, "parameters": {"max_new_tokens": 4}},
                     timeout=60)
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation"


def test_min_tokens_past_the_room_left_is_a_400_as_on_vllms_server(oai):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="tiny-llama", messages=LONG, max_tokens=CLAUDE_CODE_MAX_TOKENS,
                                    extra_body={"min_tokens": 1000})
    assert refused.value.body["message"] == "min_tokens must be less than or equal to max_tokens=576, got 1000."


def test_nan_logprobs_past_a_models_positions_are_the_floor_in_a_200(past_positions_url):
    chat = httpx.post(f"{past_positions_url}/v1/chat/completions", timeout=300, json={
        "messages": LONG, "max_tokens": 8, "logprobs": True, "top_logprobs": 2, "temperature": 0})
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [FLOOR] * 8  # NaN logits, every one
    assert all(t["logprob"] == FLOOR for c in content for t in c["top_logprobs"])
    completion = httpx.post(f"{past_positions_url}/v1/completions", timeout=300, json={
        "prompt": "x" * 3500, "max_tokens": 4, "logprobs": 1})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["logprobs"]["token_logprobs"] == [FLOOR] * 4
    tgi = httpx.post(f"{past_positions_url}/generate", timeout=300, json={
        "inputs": "x" * 3500, "parameters": {"max_new_tokens": 4, "details": True}})
    assert tgi.status_code == 200, tgi.text
    assert [t["logprob"] for t in tgi.json()["details"]["tokens"]] == [FLOOR] * 4
    assert all(math.isfinite(t["logprob"]) for t in tgi.json()["details"]["tokens"])
