"""LMI beyond the rolling-batch basics, on the real worker: several sequences, beams, prefill,
top tokens, the dynamic-batch schema, TGI compatibility (driven by huggingface_hub) and chat."""

from __future__ import annotations

import json

import httpx
import pytest
from huggingface_hub import InferenceClient

pytestmark = pytest.mark.e2e

GREEDY = {"do_sample": False, "max_new_tokens": 12}


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/invocations", json=body, timeout=120)


def _cumulative(seq: dict) -> float:
    return sum(t["log_prob"] for t in seq["tokens"])


def test_best_of_returns_the_most_likely_sequence_and_the_others(stack):
    body = {"inputs": "Once upon", "parameters": {"best_of": 3, "temperature": 1.0, "max_new_tokens": 8}}
    resp = _post(stack.url, body)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    details = result["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    best = {"tokens": details["tokens"]}
    assert all(_cumulative(best) >= _cumulative(o) for o in others)
    for seq in others:
        assert seq["generated_tokens"] == len(seq["tokens"]) and seq["finish_reason"] in ("length", "eos_token")


def test_num_beams_matches_the_engines_greedy_when_one_beam_and_returns_every_beam(stack):
    one = _post(stack.url, {"inputs": "Hello", "parameters": {"num_beams": 1, **GREEDY, "details": True}}).json()
    beams = _post(stack.url, {"inputs": "Hello", "parameters": {"num_beams": 3, "max_new_tokens": 12}})
    assert beams.status_code == 200, beams.text
    details = beams.json()["details"]
    assert len(details["best_of_sequences"]) == 2
    texts = [beams.json()["generated_text"], *(s["generated_text"] for s in details["best_of_sequences"])]
    assert len(set(texts)) == 3  # distinct beams
    assert one["generated_text"]  # the greedy path still works next to beam search


def test_decoder_input_details_and_top_n_tokens(stack):
    body = {"inputs": "The sky", "parameters": {**GREEDY, "details": True, "decoder_input_details": True,
                                                "top_n_tokens": 3}}
    details = _post(stack.url, body).json()["details"]
    prefill = details["prefill"]
    assert prefill[0]["id"] == 1 and prefill[0]["log_prob"] is None  # BOS: nothing predicts it
    assert len(prefill) > 1 and all(isinstance(t["log_prob"], float) for t in prefill[1:])
    assert len(details["top_tokens"]) == len(details["tokens"])
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 3
        # greedy: the chosen token is a most likely one (bf16 on CPU makes ties common)
        assert top[0]["log_prob"] == pytest.approx(token["log_prob"]), (token, top)
        assert [t["log_prob"] for t in top] == sorted((t["log_prob"] for t in top), reverse=True)


def test_streaming_refuses_several_sequences_as_lmi_does(stack):
    resp = _post(stack.url, {"inputs": "x", "stream": True, "parameters": {"num_beams": 2}})
    assert resp.status_code == 424 and "streaming" in resp.json()["error"]


def test_dynamic_batch_returns_one_result_per_input_in_order(stack):
    inputs = ["The quick brown fox", "Hello", "A long time ago"]
    singles = [_post(stack.url, {"inputs": x, "parameters": GREEDY}).json()["generated_text"] for x in inputs]
    batch = _post(stack.url, {"inputs": inputs, "parameters": GREEDY})
    assert batch.status_code == 200, batch.text
    assert batch.json() == [{"generated_text": t} for t in singles]
    with httpx.stream("POST", f"{stack.url}/invocations", json={"inputs": inputs, "parameters": GREEDY,
                                                                "stream": True}, timeout=120) as resp:
        lines = [json.loads(line) for line in resp.iter_lines() if line]
    assert all(len(line["outputs"]) == 3 for line in lines)
    streamed = ["".join(line["outputs"][i] for line in lines) for i in range(3)]
    assert streamed == singles
    bad = _post(stack.url, {"inputs": ["a", "b"], "parameters": {"num_beams": 2}})
    assert bad.status_code == 424 and bad.json()["message"] == "invoke handler failure"


def test_tgi_compat_serves_huggingface_hub(stack):
    url = stack.api(OPTION_TGI_COMPAT="true")
    raw = httpx.post(f"{url}/invocations", json={"inputs": "Hello", "parameters": GREEDY}, timeout=60).json()
    assert isinstance(raw, list) and set(raw[0]["details"]["tokens"][0]) == {"id", "text", "logprob", "special"}
    client = InferenceClient(model=f"{url}/invocations")
    out = client.text_generation("Hello", max_new_tokens=12, do_sample=False, details=True)
    assert out.generated_text == raw[0]["generated_text"]
    assert [t.id for t in out.details.tokens] == [t["id"] for t in raw[0]["details"]["tokens"]]
    streamed = list(client.text_generation("Hello", max_new_tokens=12, do_sample=False, details=True, stream=True))
    assert [s.token.id for s in streamed] == [t.id for t in out.details.tokens]
    assert streamed[-1].generated_text == out.generated_text
    assert streamed[-1].details.generated_tokens == len(out.details.tokens)


def test_chat_on_invocations_is_json_lines_by_default_and_sse_when_configured(stack):
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10, "temperature": 0}
    plain = _post(stack.url, body).json()
    text = plain["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{stack.url}/invocations", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("application/jsonlines")
        chunks = [json.loads(line) for line in resp.iter_lines() if line]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    with httpx.stream("POST", f"{stack.sse_url}/invocations", json={**body, "stream": True}, timeout=60) as resp:
        raw = resp.read()
    assert resp.headers["content-type"].startswith("text/event-stream") and raw.endswith(b"data: [DONE]\n\n")


def test_structured_outputs_pass_through_to_the_engine(stack):
    body = {"inputs": "Pick:", "parameters": {**GREEDY, "structured_outputs": {"choice": ["left", "right"]}}}
    assert _post(stack.url, body).json()["generated_text"] in ("left", "right")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {"inputs": "JSON:", "parameters": {"do_sample": False, "max_new_tokens": 40, "details": True,
                                              "structured_outputs": {"json": schema}}}
    result = _post(stack.url, body).json()
    assert result["details"]["finish_reason"] == "eos_token", result
    assert isinstance(json.loads(result["generated_text"])["n"], int)
