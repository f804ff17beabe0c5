"""happy_vllm's legacy generate end to end on real vLLM workers.

happy_vllm ships no client for ``/v1/generate`` (its users call it with requests/httpx), so the
tests use plain httpx.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_tokens": 24}


def _lines(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.split(b"\n")[:-1]]


def test_greedy_last_stream_line_equals_the_non_streamed_response(stack):
    body = {"prompt": "The quick brown fox", "prompt_in_response": True, **GREEDY}
    with httpx.Client(timeout=120) as client:
        plain = client.post(f"{stack.url}/v1/generate", json=body)
        assert plain.status_code == 200, plain.text
        full = plain.json()
        with client.stream("POST", f"{stack.url}/v1/generate_stream", json=body) as resp:
            assert resp.status_code == 200
            lines = _lines(resp.read())
    assert full["prompt"] == body["prompt"] and full["responses"][0]
    assert full["finish_reasons"][0] in ("stop", "length")
    usage = full["usages"][0]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0
    assert lines[-1] == full
    # cumulative: each line extends the previous one; unfinished reasons are the string "None"
    texts = [x["responses"][0] for x in lines]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert {x["finish_reasons"][0] for x in lines[:-1]} <= {"None"}
    assert {x["usages"][0]["prompt_tokens"] for x in lines} == {usage["prompt_tokens"]}


def test_n2_gives_one_entry_per_response(stack):
    body = {"prompt": "Two answers", "n": 2, "max_tokens": 6, "seed": 3, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        out = client.post(f"{stack.url}/v1/generate", json=body).json()
    assert len(out["responses"]) == len(out["finish_reasons"]) == len(out["usages"]) == 2
    assert out["finish_reasons"] == ["length", "length"]
    assert [u["completion_tokens"] for u in out["usages"]] == [6, 6]


def test_response_pool_answers_one_of_the_pool(stack):
    pool = ["mathematician", "astronaut", "show writer"]
    with httpx.Client(timeout=120) as client:
        out = client.post(
            f"{stack.url}/v1/generate",
            json={"prompt": "What was the occupation of Ada Lovelace?", "response_pool": pool, "max_tokens": 20},
        ).json()
        with client.stream(
            "POST",
            f"{stack.url}/v1/generate_stream",
            json={"prompt": "Pick one:", "response_pool": pool, "temperature": 0, "max_tokens": 20},
        ) as resp:
            last = _lines(resp.read())[-1]
    assert out["responses"][0] in pool and out["finish_reasons"] == ["stop"]
    assert last["responses"][0] in pool and last["finish_reasons"] == ["stop"]


def _valid(out: dict, valid: list[str]) -> None:
    """Constrained JSON from the random tiny model. happy_vllm's lm-format-enforcer capped runs of
    whitespace; llmq's workers emit compact JSON (LLMQ_COMPACT_JSON, on for the tiny model), so
    the answer finishes and is exactly one of the valid ones."""
    text, reason = out["responses"][0], out["finish_reasons"][0]
    assert reason == "stop" and text in valid and json.loads(text), out


def test_json_format_simple_form_is_enforced(stack):
    """happy_vllm's simple form allows extra properties (its schema has no additionalProperties:
    false), and the random tiny model may add one it never closes; so: the declared fields come
    first with the declared types, and a finished answer is valid JSON."""
    body = {
        "prompt": "Describe the weather as JSON:",
        "json_format": {"sunny": "boolean", "windy": "boolean"},
        "temperature": 0,
        "max_tokens": 60,
    }
    with httpx.Client(timeout=120) as client:
        out = client.post(f"{stack.url}/v1/generate", json=body).json()
    text, reason = out["responses"][0], out["finish_reasons"][0]
    assert re.match(r'\{"sunny":(true|false),"windy":(true|false)[,}]', text), out
    if reason == "stop":
        assert isinstance(json.loads(text)["sunny"], bool), out


def test_json_format_json_schema_is_enforced(stack):
    schema = {
        "type": "object",
        "properties": {"level": {"type": "string", "enum": ["low", "high"]}},
        "required": ["level"],
        "additionalProperties": False,
    }
    body = {
        "prompt": "Level?",
        "json_format": schema,
        "json_format_is_json_schema": True,
        "temperature": 0,
        "max_tokens": 60,
    }
    with httpx.Client(timeout=120) as client:
        out = client.post(f"{stack.url}/v1/generate", json=body).json()
    _valid(out, ['{"level":"low"}', '{"level":"high"}'])


def test_invalid_input_is_422_and_probes_answer(stack):
    with httpx.Client(timeout=30) as client:
        resp = client.post(f"{stack.url}/v1/generate", json={"prompt": "x", "response_pool": ["a"], "json_format": {}})
        assert (resp.status_code, resp.json()) == (
            422,
            {"detail": "Two keywords are incompatible : response_pool and json_format"},
        )
        resp = client.post(f"{stack.url}/v1/generate", json={"prompt": "x", "best_of": 2})
        assert resp.status_code == 422 and "best_of" in resp.json()["detail"]
        assert client.get(f"{stack.url}/liveness").json() == {"alive": "ok"}
        assert client.get(f"{stack.url}/readiness").json() == {"ready": "ok"}
        info = client.get(f"{stack.url}/v1/info").json()
        assert info["model_name"] == stack.model and info["max_length"] == 1024
