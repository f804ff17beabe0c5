"""Deadlines under overload on real vLLM (docs/guarantees.md#slos): once its worker has measured
the engine's speed, a request whose TTFT SLO the work ahead of it cannot leave room for is refused
at once (the openai and anthropic SDKs' own errors, Retry-After), one with room is served, and its
stream said where it stood while it waited."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import msgspec
import openai
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from shared.slo import Rates
from tests.support.real_processes import one_worker
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e]

SLOTS = 4


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Redis, Keys]]:
    prefix = f"slo-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": str(SLOTS), "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_SSE_KEEPALIVE_S": "0.5"}
    with one_worker(env, tmp_path_factory.mktemp("slo-logs")) as url, Redis.from_url(redis_url) as redis:
        yield url, redis, Keys(prefix)


def test_past_capacity_an_slo_out_of_reach_is_refused_and_one_in_reach_is_served(stack):
    url, redis, keys = stack
    model = load_settings({}).model_name
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for _ in range(SLOTS):  # the worker measures the engine's speed on these
        client.completions.create(model=model, prompt="warm up", max_tokens=32, extra_body={"ignore_eos": True})

    def measured() -> bool:
        raw = next((redis.hget(w, "rates") for w in redis.scan_iter(match=keys.worker("*"))), None)
        rates = msgspec.json.decode(raw, type=Rates) if raw else Rates()
        return rates.decode_tps > 0 and rates.generated_per_job > 0
    eventually_sync(measured, timeout_s=30, what="the worker to report the engine's speed")
    time.sleep(1.2)  # the API reads a model's capacity at most once a second

    # Four slots busy and twelve urgent jobs waiting, each of 512 tokens: seconds of work ahead of
    # a less urgent request.
    with httpx.Client(base_url=url, timeout=60) as http:
        flood = http.post("/v1/completions", json={"model": model, "prompt": ["Story"] * 16, "max_tokens": 512,
                                                     "ignore_eos": True}, headers={"Prefer": "respond-async"})
        assert flood.status_code == 202, flood.text
    late = {"x-slo-ttft-ms": "500", "x-llmq-priority": "1"}
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=model, prompt="p", max_tokens=4, extra_headers=late)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert "TTFT SLO of 500 ms" in str(refused.value)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "p"}],
                               extra_headers=late)
    assert overloaded.value.status_code == 529 and overloaded.value.response.headers["retry-after"]

    # Room enough: admitted; while it waits behind the urgent jobs its stream says where it stands.
    body = {"model": model, "prompt": "p", "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=url, timeout=300) as http, \
            http.stream("POST", "/v1/completions", json=body,
                        headers={"x-slo-ttft-ms": "600000", "x-llmq-priority": "1"}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    standings = [line for line in lines if line.startswith(": queue position=")]
    assert standings, lines[:5]
    assert lines[-1] == "data: [DONE]" and any(line.startswith("data: {") for line in lines)
