"""Deadlines and priorities on the real vLLM worker, with the openai SDK.

The engine runs vLLM's priority scheduler: with its default (FCFS) policy any priority but 0 is
refused, so these requests would fail. A deadline aborts the real engine's request."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def test_any_priority_runs_and_does_not_change_a_greedy_answer(stack, client):
    def complete(**extra) -> str:
        return client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=8,
                                         temperature=0, **extra).choices[0].text

    plain = complete()
    assert complete(extra_body={"priority": -3}) == plain  # more urgent than the default: level 0
    assert complete(extra_body={"priority": 7}) == plain  # the lowest level
    assert complete(extra_headers={"X-LLMQ-Priority": "1"}) == plain
    chat = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, extra_body={"priority": 2})
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_a_deadline_aborts_a_real_generation(stack, client):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=1000, temperature=0,
                                  extra_body={"ignore_eos": True}, extra_headers={"X-LLMQ-Timeout": "0.5"})
    assert err.value.status_code == 504
    assert "deadline passed while it was running" in err.value.message
    # The engine let go of it: the workers still answer at once.
    out = client.completions.create(model=stack.model, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_a_token_prompt_ending_inside_a_character_does_not_echo_the_prompt(stack):
    """A continued job's prompt (prompt + emitted ids) often ends inside a UTF-8 character. vLLM
    0.32's detokenizer then reports the whole prompt's text as the first new text; the worker
    strips it, so the text is exactly what the new tokens complete."""
    from transformers import AutoTokenizer

    from shared.config import load_settings

    tok = AutoTokenizer.from_pretrained(load_settings({}).model_path)
    ids = tok.encode("hello €uro", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    prompt = ids[:cut]  # "hello " + the first byte(s) of "€"
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        job_id = http.post("/v1/jobs", json={"prompt_token_ids": prompt,
                                             "sampling": {"max_tokens": 12, "temperature": 0}}).json()["id"]
        while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] not in ("done", "failed"):
            time.sleep(0.1)
    choice = job["result"]["choices"][0]
    complete = tok.decode(prompt[:next(k for k in range(cut, 0, -1) if not tok.decode(prompt[:k]).endswith("\ufffd"))])
    expected = tok.decode(prompt + choice["token_ids"]).removeprefix(complete)
    assert not choice["text"].startswith("hello")
    assert expected.startswith(choice["text"]) and len(expected) - len(choice["text"]) <= 1  # a held-back tail
