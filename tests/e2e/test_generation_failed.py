"""A request the engine fails is each dialect's generation failure, against real vLLM.

The worker runs under ``python -m tests.support.fault_wrap engine``: vLLM itself fails every request
whose prompt holds ``ENGINE-FAULT`` (``EngineGenerateError``, the error vLLM raises for a request
its own code cannot process), and serves every other. The worker's catch-all ends such a job with
``generation_failed``, so each client sees its server's own answer to a generation failure:
TGI's 424 ``generation`` (``huggingface_hub``'s ``GenerationError``, streamed or not), OpenAI's
and Anthropic's 500, LMI's error-shaped result; and the engine goes on serving.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import GenerationError

from tests.support.fault_wrap import ENGINE_FAULT
from tests.support.real_processes import one_worker
from tests.support.waiting import eventually_sync

pytestmark = pytest.mark.e2e

PROMPT = f"Tell me about {ENGINE_FAULT} please"


@pytest.fixture(scope="module")
def faulty(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API and one worker whose vLLM fails the marked requests, on a queue of their own."""
    logs = tmp_path_factory.mktemp("engine-fault")
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": f"fault-{uuid.uuid4().hex[:6]}",
           "LLMQ_LOG_JSON": "true", "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_MAX_MODEL_LEN": "512", "LLMQ_HEARTBEAT_S": "1"}
    with one_worker(env, logs, ("-m", "tests.support.fault_wrap", "engine")) as url:
        yield url


def test_tgi_answers_424_generation_and_its_client_raises_generation_error(faulty):
    client = InferenceClient(model=faulty)
    with pytest.raises(GenerationError, match="Request failed during generation: generation failed"):
        client.text_generation(PROMPT, max_new_tokens=4)
    with pytest.raises(GenerationError, match="Request failed during generation"):  # in-band, after a 200
        list(client.text_generation(PROMPT, max_new_tokens=4, stream=True))
    resp = httpx.post(f"{faulty}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}, timeout=60)
    assert resp.status_code == 424
    assert resp.json()["error_type"] == "generation"
    assert client.text_generation("Tell me about it", max_new_tokens=4, details=True).details.generated_tokens == 4


def test_openai_and_anthropic_answer_their_500_and_their_clients_raise_it(faulty):
    oai = openai.OpenAI(base_url=f"{faulty}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        oai.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4)
    assert failed.value.status_code == 500
    assert failed.value.body["type"] == "InternalServerError" and failed.value.body["code"] == 500
    with pytest.raises(openai.InternalServerError):  # a stream's error before its first event: the status
        list(oai.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=4, stream=True))
    claude = anthropic.Anthropic(base_url=faulty, api_key="x", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as failed_msg:
        claude.messages.create(model="tiny-llama", max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
    assert failed_msg.value.body["error"]["type"] == "api_error"
    ok = oai.completions.create(model="tiny-llama", prompt="Tell me about it", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_lmi_answers_its_error_shaped_result_and_the_job_records_generation_failed(faulty):
    resp = httpx.post(f"{faulty}/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
                      timeout=60)
    assert resp.status_code == 500
    body = resp.json()
    assert body["generated_text"] == "" and body["code"] == 500 and body["details"]["finish_reason"] == "error"
    queued = httpx.post(f"{faulty}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                        headers={"Prefer": "respond-async"}, timeout=60)
    assert queued.status_code == 202

    def ended() -> dict | None:
        job = httpx.get(f"{faulty}/v1/jobs/{queued.json()['id']}", timeout=10).json()
        return job if job["status"] not in ("queued", "running") else None
    job = eventually_sync(ended, timeout_s=60, interval_s=0.1, what="the failing job to end")
    assert job["status"] == "failed" and job["error"]["code"] == "generation_failed", job
