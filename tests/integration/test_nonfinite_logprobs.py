"""An engine that emits NaN and infinite logprobs (vLLM does, past the model's positions) gets a 200
with -9999.0 in their place, through the real API path: worker, Redis, relay, each dialect's
renderer. Before, the API failed to decode the event (JSON has no NaN: msgspec wrote null) and
answered a bare 500."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import pytest

from shared.events import TokenDelta
from shared.schemas import GenerationRequest, PromptInfo, TopLogprob
from tests.support.scripted_engine import ScriptedEngine
from workers.protocol import Step

NAN, INF = float("nan"), float("inf")
FLOOR = -9999.0
SAMPLED = [NAN, INF, -INF]
"""The logprob of each generated token: one of each that JSON cannot carry."""
OTHERS = [("x", -1.0), ("y", -INF), ("z", NAN)]
"""Each position's other alternative: a finite one is kept as it is."""


class NonFiniteEngine(ScriptedEngine):
    """Generates "abc" (up to max_tokens) with the logprobs above, and the prompt's tokens with
    NaN and -inf logprobs when asked for them."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        prompt = req.prompt or "hi"
        info = None
        if req.output.prompt_tokens:
            info = PromptInfo(token_ids=[ord(c) for c in prompt], token_texts=list(prompt),
                              logprobs=[None] + [NAN if i % 2 else -INF for i in range(1, len(prompt))])
        n, k = req.sampling.max_tokens, req.sampling.logprobs
        for i in range(n):
            char, (other, other_lp) = "abc"[i % 3], OTHERS[i % 3]
            delta = TokenDelta(token_ids=[ord(char)], text=char, token_texts=[char], logprobs=[SAMPLED[i % 3]],
                               finish_reason="length" if i == n - 1 else None)
            if k:
                delta.top_logprobs = [[TopLogprob(ord(char), char, SAMPLED[i % 3]),
                                       TopLogprob(ord(other), other, other_lp)][:k]]
            yield Step(deltas=[delta], finished=i == n - 1, prompt_tokens=len(prompt), prompt=info if i == 0 else None)


pytestmark = pytest.mark.stack(NonFiniteEngine(), prefix="nonfinite")  # tests/integration/conftest.py


def strict(raw: bytes) -> object:
    """The body as JSON that holds no NaN or Infinity (Python's json would read them)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} on the wire")
    return json.loads(raw, parse_constant=refuse)


async def test_chat_answers_200_with_the_floor_in_place_of_each_nonfinite_logprob(stack):
    resp = await stack.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert resp.status_code == 200, resp.text
    content = strict(resp.content)["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("a", FLOOR), ("b", FLOOR), ("c", FLOOR)]
    assert [[(t["token"], t["logprob"]) for t in c["top_logprobs"]] for c in content] == [
        [("a", FLOOR), ("x", -1.0)], [("b", FLOOR), ("y", FLOOR)], [("c", FLOOR), ("z", FLOOR)]]


async def test_a_chat_stream_carries_the_floor_too(stack):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "stream": True}
    async with stack.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        raw = await resp.aread()
    chunks = [strict(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    streamed = [(c["token"], c["logprob"]) for chunk in chunks for choice in chunk["choices"]
                if choice.get("logprobs") for c in choice["logprobs"]["content"]]
    assert streamed == [("a", FLOOR), ("b", FLOOR), ("c", FLOOR)] and raw.endswith(b"data: [DONE]\n\n")


async def test_completions_answer_200_with_the_floor_for_tokens_alternatives_and_the_echoed_prompt(stack):
    resp = await stack.client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3, "logprobs": 2,
                                                            "echo": True})
    assert resp.status_code == 200, resp.text
    lp = strict(resp.content)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "y", "a", "b", "c"]
    # The prompt's first token has no logprob (null, as vLLM's); its others were -inf and NaN.
    assert lp["token_logprobs"] == [None, FLOOR, FLOOR, FLOOR, FLOOR, FLOOR]
    assert lp["top_logprobs"][3:] == [{"a": FLOOR, "x": -1.0}, {"b": FLOOR, "y": FLOOR}, {"c": FLOOR, "z": FLOOR}]


async def test_tgi_answers_200_with_the_floor_in_its_details(stack):
    resp = await stack.client.post("/generate", json={"inputs": "hey", "parameters": {
        "max_new_tokens": 3, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    assert resp.status_code == 200, resp.text
    details = strict(resp.content)["details"]
    assert [(t["text"], t["logprob"]) for t in details["tokens"]] == [("a", FLOOR), ("b", FLOOR), ("c", FLOOR)]
    assert [[(t["text"], t["logprob"]) for t in top] for top in details["top_tokens"]] == [
        [("a", FLOOR), ("x", -1.0)], [("b", FLOOR), ("y", FLOOR)], [("c", FLOOR), ("z", FLOOR)]]
    # TGI's prefill: the first token without a logprob (null, as TGI's), then the prompt's -inf and NaN.
    assert [(t["text"], t["logprob"]) for t in details["prefill"]] == [("h", None), ("e", FLOOR), ("y", FLOOR)]


async def test_tgi_stream_tokens_carry_the_floor(stack):
    body = {"inputs": "hey", "parameters": {"max_new_tokens": 3}}
    async with stack.client.stream("POST", "/generate_stream", json=body) as resp:
        assert resp.status_code == 200
        raw = await resp.aread()
    events = [strict(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:")]
    assert [(e["token"]["text"], e["token"]["logprob"]) for e in events] == [("a", FLOOR), ("b", FLOOR), ("c", FLOOR)]
