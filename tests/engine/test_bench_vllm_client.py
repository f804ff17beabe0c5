"""vLLM's own benchmark client (tests/bench/vllm_client.py) against the scripted stack (real API,
real Redis, a scripted engine that streams exactly max_tokens tokens, one per step): it runs, and
its result reads back as the workload's Summary with what the stream really carried."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # the engine tier: vLLM's benchmark code is the client here

from shared.config import load_settings
from tests.bench.serving import HttpTarget, measure
from tests.bench.vllm_client import run_vllm_client, summary_of, vllm_client
from tests.support.scripted_stack import scripted_stack
from workers.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tokenizer() -> str:
    return str(ensure_tiny_model(load_settings({}).model_path))


@pytest.fixture(scope="module")
async def url(redis_url):
    async with scripted_stack(redis_url, "bench-vllm-client") as s:
        yield s.url


async def test_vllm_bench_serve_streams_every_token_and_reads_back_as_a_summary(url, tokenizer):
    summary = await run_vllm_client(url, "tiny", tokenizer, concurrency=2, requests=6, max_tokens=MAX_TOKENS,
                                    input_tokens=16)
    assert summary.ok, summary.errors
    assert summary.requests == summary.completed == 6 and summary.concurrency == 2
    # The scripted engine yields one token per step, and llmq streams one chunk per step unless its
    # flusher falls behind the engine: then a job's steps share one chunk (merged token events,
    # shared/chunking.py), as a loaded CI box made them. Never more chunks than tokens, though.
    assert 1.0 <= summary.tokens_per_chunk <= MAX_TOKENS
    # The two figures agree up to their rounding: the duration to the ms (a run of 6 short requests
    # lasts about 50 ms here, so that alone is 1 %), the rate to 0.1 token/s.
    assert 6 * MAX_TOKENS / summary.output_tokens_per_s == pytest.approx(summary.duration_s, abs=0.0006)
    assert 0 < summary.ttft_p50_ms <= summary.ttft_p99_ms
    assert 0 < summary.itl_p50_ms <= summary.itl_p99_ms


async def test_the_client_runs_in_the_interleaved_rounds_with_a_cell_seeded_prompt_set(url, tokenizer):
    target = HttpTarget("llmq", url, "tiny", client=vllm_client(tokenizer, input_tokens=8))
    runs = await measure([target], rounds=1, concurrencies=[1], requests=3, max_tokens=MAX_TOKENS, progress=False)
    [run] = runs
    assert run.summary.ok and run.summary.completed == 3 and run.summary.concurrency == 1


def test_a_short_or_failed_request_fails_the_summary():
    result = {"duration": 2.0, "output_lens": [4, 3, 0], "ttfts": [0.01, 0.02, 0.0],
              "itls": [[0.001] * 3, [0.001] * 2, []], "errors": ["", "", "HTTP 503"]}
    summary = summary_of(result, concurrency=1, max_tokens=4)
    assert not summary.ok
    assert summary.completed == 1 and summary.requests == 3
    assert summary.errors == ["HTTP 503", "1 requests did not return 4 tokens"]
    assert summary.output_tokens_per_s == 2.0 and summary.tokens_per_chunk == 1.0
