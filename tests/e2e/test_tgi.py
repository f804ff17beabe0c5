"""TGI end to end on real vLLM workers, driven by the real client: huggingface_hub.InferenceClient
(which posts to ``/`` and reads the array / SSE forms), plus httpx for /info, /health, /tokenize."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def hub(stack) -> InferenceClient:
    return InferenceClient(model=stack.url, timeout=120)


@pytest.fixture(scope="module")
def endpoint(stack) -> InferenceClient:
    """Endpoint info and health need the hf-inference provider named explicitly."""
    return InferenceClient(model=stack.url, provider="hf-inference", timeout=120)


def test_greedy_stream_equals_non_stream(hub):
    kw = dict(max_new_tokens=24, details=True, decoder_input_details=False)
    plain = hub.text_generation(PROMPT, **kw)
    events = list(hub.text_generation(PROMPT, stream=True, **kw))
    assert plain.generated_text.startswith(PROMPT)  # `/` returns the full text unless told otherwise
    assert plain.details.generated_tokens == len(plain.details.tokens) == len(events)
    assert [e.token.id for e in events] == [t.id for t in plain.details.tokens]
    assert [e.token.text for e in events] == [t.text for t in plain.details.tokens]
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == plain.generated_text
    assert events[-1].details.finish_reason == plain.details.finish_reason
    assert events[-1].details.input_length > 0
    text = "".join(e.token.text for e in events if not e.token.special)
    assert PROMPT + text == plain.generated_text
    # The default (non-details) stream yields token texts only.
    texts = list(hub.text_generation(PROMPT, max_new_tokens=24, stream=True))
    assert texts == [t.text for t in plain.details.tokens]


def test_prefill_matches_tokenize_and_top_tokens_rank_the_greedy_choice(hub, stack):
    out = hub.text_generation(PROMPT, max_new_tokens=6, details=True, decoder_input_details=True, top_n_tokens=3)
    tokens = httpx.post(f"{stack.url}/tokenize", json={"inputs": PROMPT}, timeout=120).json()
    assert [p.id for p in out.details.prefill] == [t["id"] for t in tokens]
    assert out.details.prefill[0].logprob is None and all(p.logprob <= 0 for p in out.details.prefill[1:])
    assert len(out.details.top_tokens) == len(out.details.tokens) == 6
    for tok, top in zip(out.details.tokens, out.details.top_tokens, strict=True):
        # The client leaves these nested lists as dicts. Greedy: the sampled token ranks first.
        assert 1 <= len(top) <= 3 and top[0]["id"] == tok.id
        assert top[0]["logprob"] == pytest.approx(tok.logprob, abs=1e-4)


def test_best_of_returns_the_other_sequence(hub):
    out = hub.text_generation(PROMPT, max_new_tokens=8, details=True, best_of=2, do_sample=True, return_full_text=False)
    [other] = out.details.best_of_sequences
    assert other.generated_tokens == len(other.tokens) and other.finish_reason in ("length", "eos_token")
    best = sum(t.logprob for t in out.details.tokens)
    assert best >= sum(t.logprob for t in other.tokens) - 1e-4  # the answer has the higher cumulative logprob


def test_stop_sequence_is_included_and_reported(hub):
    full = hub.text_generation(PROMPT, max_new_tokens=24, return_full_text=False)
    stop = full[4:6]
    out = hub.text_generation(PROMPT, max_new_tokens=24, return_full_text=False, stop=[stop], details=True)
    assert out.generated_text == full[: full.index(stop) + len(stop)]
    assert out.details.finish_reason == "stop_sequence"


def test_grammar_regex_and_json_outputs_validate(hub):
    phone = hub.text_generation(
        "Call me at", max_new_tokens=20, return_full_text=False, grammar={"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), phone
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["age", "ok"],
        "additionalProperties": False,
    }
    raw = hub.text_generation(
        "JSON:", max_new_tokens=60, return_full_text=False, grammar={"type": "json", "value": schema}
    )
    obj = json.loads(raw)
    assert set(obj) == {"age", "ok"} and isinstance(obj["age"], int) and isinstance(obj["ok"], bool)


def test_truncate_keeps_the_last_tokens(stack):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "truncate": 3, "details": True}}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{stack.url}/generate_stream", json=body) as resp:
            frames = [line for line in resp.iter_lines() if line.startswith("data:")]
        final = json.loads(frames[-1].removeprefix("data:"))
        assert final["details"]["input_length"] == 3
        plain = client.post(
            f"{stack.url}/generate", json={**body, "parameters": {**body["parameters"], "decoder_input_details": True}}
        )
    ids = [t["id"] for t in httpx.post(f"{stack.url}/tokenize", json={"inputs": PROMPT}, timeout=120).json()]
    assert [p["id"] for p in plain.json()["details"]["prefill"]] == ids[-3:]


def test_client_error_classes(hub):
    with pytest.raises(ValidationError, match="`top_p` must be > 0.0 and < 1.0"):
        hub.text_generation(PROMPT, top_p=1.0)
    with pytest.raises(ValidationError, match="not supported when streaming tokens"):
        list(hub.text_generation(PROMPT, best_of=2, do_sample=True, stream=True))
    with pytest.raises(ValidationError, match="`stop` supports up to 4"):
        list(hub.text_generation(PROMPT, stop=["a", "b", "c", "d", "e"], stream=True))


def test_info_health_and_tokenize(endpoint, stack):
    info = endpoint.get_endpoint_info()
    required = {
        "model_id",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "validation_workers",
        "max_client_batch_size",
        "router",
        "version",
    }
    assert required <= set(info)
    assert info["model_id"] == stack.model and info["max_total_tokens"] == 1024 and info["max_input_tokens"] == 1023
    assert endpoint.health_check() is True
    resp = httpx.get(f"{stack.url}/health", timeout=30)
    assert resp.status_code == 200 and resp.content == b""
    tokens = httpx.post(f"{stack.url}/tokenize", json={"inputs": "Hello world"}, timeout=120).json()
    assert tokens[0]["start"] == tokens[0]["stop"] == 0  # the BOS the engine adds too
    assert "".join(t["text"] for t in tokens) == "Hello world"
    assert all("Hello world"[t["start"] : t["stop"]] == t["text"] for t in tokens)
