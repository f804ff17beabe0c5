"""The context length on the API side, with scripted engines: what is advertised is what the warm
workers report in their heartbeats, and ``max_tokens`` past the context is queued, not refused
(the real worker clamps it: tests/e2e/test_long_context.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest

from shared.keys import Keys
from shared.queue import Consumer
from shared.redis import connect
from tests.support.scripted_engine import CappedEngine, ScriptedEngine
from tests.support.scripted_stack import scripted_settings, serve_api
from tests.support.waiting import eventually
from workers.runner import Worker

# API and first worker: 65536 (LLMQ_MAX_MODEL_LEN=65536 make run); at most 4 tokens per job.
pytestmark = pytest.mark.stack(CappedEngine(delay_s=0.0), max_model_len=65536)

CLAUDE_CODE_MAX_TOKENS = 32000


async def advertised(stack) -> dict[str, int]:
    """The context length each route advertises for the stack's model."""
    client = stack.client
    models = (await client.get("/v1/models")).json()["data"]
    tgi = (await client.get("/info")).json()
    happy = (await client.get("/v1/info")).json()
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.url.replace("http", "ws") + "/") as ws:
        await ws.send_str("MODEL_INFO " + json.dumps({"stream_id": 1, "model": "tiny"}))
        [lmtp] = json.loads((await asyncio.wait_for(ws.receive_str(), 10)).partition(" ")[2])
    assert tgi["max_input_tokens"] == tgi["max_total_tokens"] - 1
    return {"models": models[0]["max_model_len"], "tgi": tgi["max_total_tokens"], "happy_vllm": happy["max_length"],
            "lmtp": lmtp["model_info"]["max_model_len"]}


async def test_every_route_advertises_the_least_context_its_warm_workers_serve(stack):
    everywhere = dict.fromkeys(("models", "tgi", "happy_vllm", "lmtp"), 65536)
    assert await advertised(stack) == everywhere
    # A worker serving a shorter context joins (another host's settings): a request may reach it,
    # so the shorter length is the one every route advertises, whatever this API's setting says.
    short = scripted_settings(stack.settings.redis_url, stack.settings.prefix, served_model_name="tiny",
                              max_model_len=1024, block_ms=200)
    redis = connect(stack.settings.redis_dsn)
    worker = Worker(short, Consumer(redis, Keys(short.prefix)), ScriptedEngine(),
                    worker_id=f"short-{uuid.uuid4().hex[:4]}")
    task = asyncio.create_task(worker.run())
    try:
        async def registered() -> bool:
            return await redis.zscore(Keys(short.prefix).workers("tiny"), worker.worker_id) is not None
        await eventually(registered, timeout_s=30, what="the short-context worker to register")
        assert await advertised(stack) == dict.fromkeys(everywhere, 1024)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await redis.aclose()
    assert await advertised(stack) == everywhere  # it left: the stack's own worker is the only one


async def test_with_no_warm_worker_the_apis_own_setting_is_advertised(stack):
    # A model configured here (LLMQ_MODELS) that no worker serves yet: the length the next worker
    # started with these settings serves.
    cold = scripted_settings(stack.settings.redis_url, stack.settings.prefix, served_model_name="tiny",
                             models="cold", max_model_len=8192)
    async with serve_api(cold) as url:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
            cards = {c["id"]: c["max_model_len"] for c in (await resp.json())["data"]}
    assert cards == {"tiny": 65536, "cold": 8192}  # tiny: its warm worker's report, not this API's 8192


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CLAUDE_CODE_MAX_TOKENS}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": CLAUDE_CODE_MAX_TOKENS}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 100_000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}),
])
async def test_max_tokens_past_the_context_is_queued_as_asked_not_refused(stack, path, body):
    engine = stack.worker.engine
    before = len(engine.requests)
    resp = await stack.client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    asked = next(v for k, v in body.items() if k.startswith("max_"))
    assert engine.requests[before].sampling.max_tokens == asked  # the worker's engine clamps it to the context


async def test_tgi_checks_max_new_tokens_against_the_context_its_info_advertises(stack):
    # TGI's router refuses max_new_tokens >= max_total_tokens; /info says 65536 here (the worker's).
    resp = await stack.client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 65536}})
    assert resp.status_code == 422 and resp.json()["error"].endswith("`max_new_tokens` must be <= 65535. Given: 65536")
    resp = await stack.client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 65535}})
    assert resp.status_code == 200  # past any prompt's room, but within TGI's own bound: clamped by the worker
