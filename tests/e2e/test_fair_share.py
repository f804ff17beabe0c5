"""Fair share between tenants on the real vLLM workers, with the openai SDK: a tenant that floods
the queue cannot push another tenant's time to first token past its uncontended TTFT plus one
batch turnover (the time a slot takes to come free: one of the flood's jobs running start to
end). Tenants are named by a trusted gateway's header (LLMQ_TENANT_HEADER)."""

from __future__ import annotations

import statistics
import time

import httpx
import openai
import pytest
import redis as redis_sync

from shared.keys import Keys

pytestmark = pytest.mark.e2e

HEADER = "x-tenant"
FLOOD = 400  # 6 engine batches' worth for 2 workers of 32 slots, 200 tokens each


def ttft_s(client: openai.OpenAI, model: str, tenant: str) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       stream=True, extra_headers={HEADER: tenant})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    assert first is not None
    return first


def test_a_flooding_tenant_cannot_push_another_tenants_ttft_past_one_batch_turnover(stack):
    url = stack.api(LLMQ_TENANT_HEADER=HEADER)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    redis = redis_sync.Redis.from_url(stack.redis_url)
    keys = Keys(stack.prefix)
    uncontended = statistics.median(ttft_s(client, stack.model, "light") for _ in range(5))

    # The flood: fire-and-poll (Prefer: respond-async) through the same SDK.
    flood = [client.completions.with_raw_response.create(
        model=stack.model, prompt="Tell me a long story", max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={HEADER: "heavy", "Prefer": "respond-async"},
    ).http_response.json()["id"] for _ in range(FLOOD)]
    try:
        contended = []
        for _ in range(5):
            assert redis.llen(keys.tenant_waiting(stack.model, "heavy")) > 0, "the flood must still be waiting"
            contended.append(ttft_s(client, stack.model, "light"))
        waiting_after = redis.llen(keys.tenant_waiting(stack.model, "heavy"))
        durations = []
        for job_id in flood:
            raw = redis.hmget(keys.job(stack.model, job_id), "started_at", "finished_at")
            if raw[0] and raw[1]:
                durations.append(float(raw[1]) - float(raw[0]))
        turnover = statistics.median(durations) / 1000
        print(f"light tenant TTFT: uncontended p50 {uncontended * 1000:.0f} ms; under the flood "
              f"{[round(t * 1000) for t in contended]} ms; one batch turnover {turnover * 1000:.0f} ms "
              f"({len(durations)} flood jobs finished, {waiting_after} still waiting)")
        assert waiting_after > 0
        assert max(contended) <= uncontended + turnover
    finally:
        with httpx.Client(base_url=url, timeout=30) as http:
            for job_id in flood:  # the rest of the session's tests run on these workers
                http.delete(f"/v1/jobs/{job_id}")
