"""A tenant's quotas over HTTP, on the real app and a real worker (scripted engine): each limit
refuses at the right count, with Retry-After from the tenant's own figures, in every dialect's
shape; other tenants are not refused meanwhile; and ``GET /v1/usage`` returns the caller's own
usage."""

from __future__ import annotations

import json

import pytest

from shared.keys import Keys
from shared.tenants import today
from tests.support.job_records import MODEL, wait_status
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack

HEADER = "x-tenant"

RATE_CASES = [
    # path, body, status, check(body)
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 429,
     lambda b: b["error"]["type"] == "RateLimitError" and b["error"]["code"] == 429),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, 429,
     lambda b: b["error"]["type"] == "RateLimitError"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}, 429,
     lambda b: b["error"]["type"] == "rate_limit_error" and b["error"]["code"] == "rate_limited"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, 429,
     lambda b: b["error_type"] == "overloaded"),
    ("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 2}}, 429,
     lambda b: b == {"code": 429, "type": "rate_limited", "message": b["message"]}),
    # Triton has no 429: UNAVAILABLE, which its HTTP frontend answers with 503.
    (f"/v2/models/{MODEL}/generate", {"text_input": "x", "parameters": {"max_tokens": 2}}, 503,
     lambda b: set(b) == {"error"}),
    ("/v1/generate", {"prompt": "x", "max_tokens": 2}, 429, lambda b: set(b) == {"detail"}),
    ("/v1/jobs", {"prompt": "x", "sampling": {"max_tokens": 2}}, 429,
     lambda b: b["error"]["code"] == "rate_limited" and b["error"]["status"] == 429),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}, 429,
     lambda b: b == {"type": "error", "error": {"type": "rate_limit_error", "message": b["error"]["message"]}}),
]


async def refused_everywhere(client, tenant: str, retry_after: tuple[int, int]) -> None:
    for path, body, status, check in RATE_CASES:
        resp = await client.post(path, json=body, headers={HEADER: tenant})
        assert resp.status_code == status, (path, resp.text)
        assert retry_after[0] <= int(resp.headers["retry-after"]) <= retry_after[1], (path, resp.headers)
        assert check(resp.json()), (path, resp.json())
    # TGI's stream answers 200 and sends the refusal as its one error event, as TGI does.
    resp = await client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                             headers={HEADER: tenant})
    assert resp.status_code == 200
    assert json.loads(resp.content.removeprefix(b"data:"))["error_type"] == "overloaded"


@pytest.mark.faults
async def test_running_and_queued_limits_refuse_the_next_request_in_every_dialect(redis_url, prefix):
    engine = ScriptedEngine(delay_s=0.1)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=4, tenant_header=HEADER) as s:
        keys = Keys(prefix)
        await s.redis.hset(keys.tenant_config("team-a"), mapping={"max_running": 1, "max_queued": 1})
        ids = []
        for _ in range(2):  # one runs, one waits behind the running limit (engine slots are free)
            resp = await s.client.post("/v1/jobs", json={"prompt": "hold", "sampling": {"max_tokens": 200}},
                                       headers={HEADER: "team-a"})
            assert resp.status_code == 202
            ids.append(resp.json()["id"])
        await wait_status(s.redis, prefix, ids[0], {"running"})
        assert (await s.redis.hget(keys.job(MODEL, ids[1]), "status")) == b"queued"
        await refused_everywhere(s.client, "team-a", (1, 1))
        assert await s.redis.scard(keys.tenant_running(MODEL, "team-a")) == 1
        # Another tenant is served meanwhile, by the slots team-a may not use.
        resp = await s.client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2},
                                   headers={HEADER: "team-b"})
        assert resp.status_code == 200, resp.text
        # Room again once a job ends.
        assert (await s.client.delete(f"/v1/jobs/{ids[0]}")).status_code == 200
        await wait_status(s.redis, prefix, ids[1], {"running"})
        resp = await s.client.post("/v1/jobs", json={"prompt": "x", "sampling": {"max_tokens": 2}},
                                   headers={HEADER: "team-a"})
        assert resp.status_code == 202
        assert (await s.client.delete(f"/v1/jobs/{ids[1]}")).status_code == 200


async def test_a_tenant_header_that_is_no_name_is_a_400(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, tenant_header=HEADER) as s:
        resp = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                   headers={HEADER: "a b"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == HEADER


@pytest.mark.faults
async def test_tokens_per_minute_refuses_until_the_window_has_room(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, tenant_header=HEADER) as s:
        keys = Keys(prefix)
        await s.redis.hset(keys.tenant_config("team-t"), "tokens_per_minute", 100)
        # 8 prompt + 50 generated tokens each: the first two fit in 100, the third is refused.
        for _ in range(2):
            resp = await s.client.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 50},
                                       headers={HEADER: "team-t"})
            assert resp.status_code == 200
            assert resp.json()["usage"]["total_tokens"] == 58
        await refused_everywhere(s.client, "team-t", (55, 60))
        window = await s.redis.hgetall(keys.tenant_tokens(MODEL, "team-t"))
        assert sum(int(v) for v in window.values()) == 116
        # The window empties: the oldest second leaves it, and the tenant is served again.
        oldest = min(int(k) for k in window)
        await s.redis.delete(keys.tenant_tokens(MODEL, "team-t"))
        await s.redis.hset(keys.tenant_tokens(MODEL, "team-t"), str(oldest - 60), 116)
        resp = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={HEADER: "team-t"})
        assert resp.status_code == 200


async def test_usage_is_the_callers_own_by_day_and_model(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, tenant_header=HEADER) as s:
        for tenant, prompts in (("team-u", 3), ("team-v", 1)):
            for _ in range(prompts):
                resp = await s.client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 6},
                                           headers={HEADER: tenant})
                assert resp.status_code == 200
        resp = await s.client.get("/v1/usage", headers={HEADER: "team-u"})
        assert resp.status_code == 200
        page = resp.json()
        assert page["tenant"] == "team-u" and page["end_date"] == today()
        [row] = page["data"]
        assert row["date"] == today() and row["model"] == MODEL
        assert (row["requests"], row["prompt_tokens"], row["generated_tokens"]) == (3, 12, 18)
        assert row["engine_seconds"] > 0
        assert (await s.client.get("/v1/usage", headers={HEADER: "nobody"})).json()["data"] == []
        assert (await s.client.get("/v1/usage?days=0", headers={HEADER: "team-u"})).status_code == 400
