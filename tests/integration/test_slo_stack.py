"""Deadlines under overload through the real app, a real Redis and a worker (scripted engine): a
request predicted to miss its TTFT SLO refused at once in each dialect's shape, from the rates the
worker measured and reported; a job whose first-token deadline passed while it waited never
started; the prediction's error in /metrics (docs/guarantees.md#slos)."""

from __future__ import annotations

import asyncio
import uuid

import msgspec

from shared.keys import Keys
from shared.slo import Rates
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually, job_status

# Two slots; a token every 50 ms: a 10-token job holds its slot half a second.
SETTINGS = dict(max_num_seqs=2, heartbeat_s=0.3)


def fill(n: int, *, tokens: int = 10, priority: int = 0) -> list[dict]:
    return [{"prompt": f"fill {i}", "max_tokens": tokens, "ignore_eos": True, "priority": priority} for i in range(n)]


async def queue(client, body: dict, headers: dict | None = None):
    return await client.post("/v1/completions", json=body, headers={"Prefer": "respond-async", **(headers or {})})


async def measured(s) -> Rates:
    """The worker's rates once its heartbeat reports a measured speed."""
    key = Keys(s.settings.prefix).worker(s.worker.worker_id)

    async def rates() -> Rates | None:
        raw = await s.redis.hget(key, "rates")
        found = msgspec.json.decode(raw, type=Rates) if raw else None
        return found if found is not None and found.decode_tps > 0 and found.generated_per_job > 0 else None
    found = await eventually(rates, timeout_s=30, what="the worker to report measured rates")
    await asyncio.sleep(1.1)  # the API reads a model's capacity at most once a second (ModelRegistry.cache_s)
    return found


async def test_a_request_that_cannot_make_its_slo_is_refused_in_each_dialects_shape(redis_url):
    async with scripted_stack(redis_url, f"slo-{uuid.uuid4().hex[:6]}", ScriptedEngine(delay_s=0.05),
                              **SETTINGS) as s:
        for r in [await queue(s.client, b) for b in fill(4)]:  # the worker measures its speed on these
            assert r.status_code == 202, r.text
        rates = await measured(s)
        # Eight urgent jobs ahead of two busy slots: seconds of work ahead of a less urgent request.
        for r in [await queue(s.client, b) for b in fill(8)]:
            assert r.status_code == 202, r.text
        late = {"x-slo-ttft-ms": "300", "x-llmq-priority": "1"}
        cases = [
            ("/v1/completions", {"prompt": "p", "max_tokens": 2}, 429),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "p"}], "max_tokens": 2}, 429),
            ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "p"}]}, 529),
            ("/generate", {"inputs": "p", "parameters": {"max_new_tokens": 2}}, 429),
        ]
        for path, body, status in cases:
            resp = await s.client.post(path, json=body, headers=late)
            assert resp.status_code == status, (path, resp.text)
            assert int(resp.headers["retry-after"]) >= 1
            assert "TTFT SLO of 300 ms" in resp.text, resp.text
        openai = (await s.client.post("/v1/completions", json={"prompt": "p"}, headers=late)).json()
        assert openai["error"]["type"] == "RateLimitError", openai  # vLLM's shape: its code is the status
        jobs = await s.client.post("/v1/jobs", json={"prompt": "p", "slo": {"ttft_ms": 300}, "priority": 1})
        assert jobs.status_code == 429 and "slo_unattainable" in jobs.text, jobs.text
        # The same request with room for the work ahead is admitted; without an SLO, always.
        loose = await queue(s.client, {"prompt": "p", "max_tokens": 2}, {"x-slo-ttft-ms": "600000"})
        assert loose.status_code == 202, loose.text
        assert (await queue(s.client, {"prompt": "p", "max_tokens": 2}, {"x-llmq-priority": "1"})).status_code == 202
        assert rates.prefill_tps > 0


async def test_a_job_whose_first_token_deadline_passes_while_it_waits_never_starts(redis_url):
    # A fresh worker has measured nothing: admission refuses nothing, so the job is queued.
    async with scripted_stack(redis_url, f"slo-{uuid.uuid4().hex[:6]}", ScriptedEngine(delay_s=0.05),
                              **SETTINGS) as s:
        for r in [await queue(s.client, b) for b in fill(2, tokens=30)]:  # both slots, 1.5 s each
            assert r.status_code == 202, r.text
        polled = await queue(s.client, {"prompt": "p", "max_tokens": 2}, {"x-slo-ttft-ms": "400"})
        assert polled.status_code == 202, polled.text
        streamed = await s.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "stream": True},
                                       headers={"x-slo-ttft-ms": "400"})
        assert streamed.status_code == 200
        # Its stream: keep-alives while it waited, then the in-band 504 (vLLM's shape), no token.
        assert b'first-token deadline' in streamed.content and b'"code":504' in streamed.content, streamed.content
        assert b'"text"' not in streamed.content
        view = await job_status(s.client, polled.json()["id"])
        assert view["status"] == "failed" and view["error"]["code"] == "deadline_exceeded", view
        assert view["started_at"] is None and view["first_token_at"] is None
        assert "first-token deadline" in view["error"]["message"]
        assert view["slo"]["ttft_met"] is False


async def test_the_prediction_and_its_error_are_metrics(redis_url):
    async with scripted_stack(redis_url, f"slo-{uuid.uuid4().hex[:6]}", ScriptedEngine(delay_s=0.02),
                              **SETTINGS) as s:
        for r in [await queue(s.client, b) for b in fill(3)]:
            assert r.status_code == 202, r.text
        await measured(s)
        ids = [(await queue(s.client, b)).json()["id"] for b in fill(4)]
        for job_id in ids:
            assert (await job_status(s.client, job_id))["status"] == "done"

        async def counted() -> str | None:
            await asyncio.sleep(0.3)  # the next heartbeat carries the worker's metrics
            text = (await s.client.get("/metrics")).text
            lines = [line for line in text.splitlines() if line.startswith("llmq_ttft_predictions_total")]
            return text if sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 4 else None
        text = await eventually(counted, timeout_s=10, what="the predictions in /metrics")
        assert "llmq_ttft_prediction_error_seconds_count" in text and "llmq_ttft_predicted_seconds_count" in text
