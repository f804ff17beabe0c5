"""Triton's generate extension end to end on real vLLM workers.

No Python client speaks Triton's generate extension (``tritonclient`` covers KServe infer,
health and metadata only), so generate and generate_stream are driven with plain httpx, and
``tritonclient.http`` checks the health and metadata routes it does cover.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_tokens": 24}


def _events(raw: bytes) -> list[dict]:
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"", raw[-50:]  # every event is complete; no terminator follows
    assert all(f.startswith(b"data: ") for f in frames[:-1]), frames[:3]
    return [json.loads(f[len(b"data: ") :]) for f in frames[:-1]]


def test_greedy_stream_deltas_concatenate_to_the_non_streamed_text(stack):
    base = f"{stack.url}/v2/models/{stack.model}"
    body = {
        "id": "req-1",
        "text_input": "The quick brown fox",
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_output_tokens": True,
        "return_num_input_tokens": True,
        "parameters": GREEDY,
    }
    with httpx.Client(timeout=120) as client:
        plain = client.post(f"{base}/generate", json=body)
        assert plain.status_code == 200, plain.text
        full = plain.json()
        with client.stream("POST", f"{base}/generate_stream", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
            events = _events(resp.read())
    assert full["id"] == "req-1" and full["model_name"] == stack.model and full["model_version"] == "1"
    assert full["text_output"] and full["finish_reason"] in ("stop", "length")
    assert full["num_output_tokens"] >= 1 and full["num_input_tokens"] >= 1
    assert "".join(e["text_output"] for e in events) == full["text_output"]
    assert all(e["id"] == "req-1" for e in events)
    assert [e["finish_reason"] for e in events][:-1] == ["None"] * (len(events) - 1)
    assert events[-1]["finish_reason"] == full["finish_reason"]
    assert sum(e["num_output_tokens"] for e in events) == full["num_output_tokens"]
    assert {e["num_input_tokens"] for e in events} == {full["num_input_tokens"]}


def test_non_streamed_text_output_includes_the_prompt_by_default(stack):
    url = f"{stack.url}/v2/models/{stack.model}/versions/1/generate"
    prompt = "Once upon a time"
    with httpx.Client(timeout=120) as client:
        with_prompt = client.post(url, json={"text_input": prompt, "parameters": GREEDY}).json()
        without = client.post(
            url, json={"text_input": prompt, "parameters": {**GREEDY, "exclude_input_in_output": True}}
        ).json()
    assert with_prompt["text_output"] == prompt + without["text_output"]


def _valid(out: dict, valid: list[str]) -> None:
    """Constrained JSON from the random tiny model: the workers run with compact JSON (no optional
    whitespace; LLMQ_COMPACT_JSON defaults on for the tiny model), so it finishes as a valid answer."""
    assert out["finish_reason"] == "stop" and out["text_output"] in valid, out


def test_structured_outputs_choice_regex_and_json_schema(stack):
    url = f"{stack.url}/v2/models/{stack.model}/generate"
    choices = ["yes", "no", "maybe"]
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": choices}},
        "required": ["answer"],
        "additionalProperties": False,
    }

    def ask(prompt: str, structured: dict, max_tokens: int) -> dict:
        body = {
            "text_input": prompt,
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "parameters": {"max_tokens": max_tokens, "temperature": 0, "structured_outputs": json.dumps(structured)},
        }
        resp = client.post(url, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    with httpx.Client(timeout=120) as client:
        picked = ask("Is it raining?", {"choice": choices}, 10)
        as_regex = ask("Answer in JSON:", {"regex": r'\{"answer":"(yes|no|maybe)"\}'}, 20)
        shaped = ask("Answer in JSON:", {"json": schema}, 60)
    assert picked["text_output"] in choices and picked["finish_reason"] == "stop"
    # A regex has no optional whitespace: the model must finish, with JSON that validates.
    assert as_regex["finish_reason"] == "stop" and json.loads(as_regex["text_output"])["answer"] in choices
    _valid(shaped, [json.dumps({"answer": c}, separators=(",", ":")) for c in choices])


def test_errors_are_triton_error_objects(stack):
    with httpx.Client(timeout=60) as client:
        resp = client.post(f"{stack.url}/v2/models/no-such-model/generate", json={"text_input": "x"})
        assert resp.status_code == 404
        assert resp.json() == {"error": "Request for unknown model: 'no-such-model' is not found"}
        resp = client.post(f"{stack.url}/v2/models/{stack.model}/versions/one/generate", json={"text_input": "x"})
        assert (resp.status_code, resp.json()) == (404, {"error": "Not Found"})
        resp = client.post(
            f"{stack.url}/v2/models/{stack.model}/generate", json={"text_input": "x", "parameters": {"temperature": 9}}
        )
        assert resp.status_code == 400 and "temperature" in resp.json()["error"]


def test_health_metadata_and_readiness_status_codes(stack):
    base = f"{stack.url}/v2"
    with httpx.Client(timeout=30) as client:
        for path in (
            "/health/live",
            "/health/ready",
            f"/models/{stack.model}/ready",
            f"/models/{stack.model}/versions/1/ready",
        ):
            resp = client.get(base + path)
            assert (resp.status_code, resp.content) == (200, b""), path
        assert client.get(f"{base}/models/no-such-model/ready").status_code == 400
        assert client.get(f"{base}/models/{stack.model}/versions/2/ready").status_code == 400
        assert client.get(f"{base}/models/no-such-model").status_code == 404
        assert client.post(f"{base}/health/ready").status_code == 405


def test_tritonclient_reads_health_and_metadata(stack):
    tritonhttp = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    client = tritonhttp.InferenceServerClient(url=stack.url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(stack.model) and client.is_model_ready(stack.model, "1")
        assert not client.is_model_ready("no-such-model")
        assert client.get_server_metadata()["name"] == "llmq"
        meta = client.get_model_metadata(stack.model)
        assert meta["name"] == stack.model and meta["versions"] == ["1"]
        assert [i["name"] for i in meta["inputs"]][:2] == ["text_input", "stream"]
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_model_metadata("no-such-model")
    finally:
        client.close()
