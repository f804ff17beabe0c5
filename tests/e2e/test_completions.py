"""OpenAI completions beyond one prompt, with the openai SDK on the real worker: lists of
prompts (one job each), echo, echo with logprobs, n across prompts, and model routing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def test_a_list_of_prompts_numbers_choices_across_prompts(stack, client):
    prompts = ["The quick brown fox", "Hello", "Once upon a time"]
    singles = [client.completions.create(model=stack.model, prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
    batch = client.completions.create(model=stack.model, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.completion_tokens == 24

    stream = client.completions.create(model=stack.model, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts = ["", "", ""]
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == singles and usage.completion_tokens == 24


def test_n_with_a_list_of_prompts(stack, client):
    out = client.completions.create(model=stack.model, prompt=["a", "b"], n=2, max_tokens=4, temperature=1.0, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]


def test_echo_prefixes_the_prompt_streamed_and_not(stack, client):
    plain = client.completions.create(model=stack.model, prompt="Hello there", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=stack.model, prompt="Hello there", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    stream = client.completions.create(model=stack.model, prompt="Hello there", max_tokens=6, temperature=0,
                                       echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(stack, client):
    out = client.completions.create(model=stack.model, prompt=[1, 50, 60, 70], max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and out.choices[0].text.startswith(lp.tokens[0])


def test_unknown_model_is_404_and_models_lists_the_live_one(stack, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="x", max_tokens=2)
    assert [m.id for m in client.models.list().data] == [stack.model]
    lmi = httpx.post(f"{stack.url}/predictions/not-served", json={"inputs": "x"}, timeout=30)
    assert lmi.status_code == 404 and lmi.json()["code"] == 404


def test_structured_outputs_on_completions(stack, client):
    pick = client.completions.create(model=stack.model, prompt="Pick:", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert pick.choices[0].text in ("red", "green") and pick.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.completions.create(
        model=stack.model, prompt="JSON:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].text) in ({"ok": True}, {"ok": False})
