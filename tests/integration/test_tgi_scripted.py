"""TGI routes on a real port, real Redis and a scripted engine: exact wire bytes, in-band errors,
and the huggingface_hub client's error classes (including 429, which real vLLM cannot produce).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import GenerationError, OverloadedError, ValidationError

from shared.errors import GenerationFailed, Overloaded
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, PromptInfo, TopLogprob
from tests.support.scripted_engine import ScriptedEngine
from workers.protocol import Step

EOS = 2


class TgiEngine(ScriptedEngine):
    """The scripted engine plus what TGI needs: n sequences, prompt tokens, top logprobs, EOS,
    and failures on cue (by prompt)."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        prompt = req.prompt or ""
        if prompt == "overload":
            raise Overloaded("Model is overloaded")
        if prompt == "crash":
            raise GenerationFailed("the engine fell over")
        if prompt == "slow":
            await asyncio.sleep(1.3)  # > 2 keep-alive intervals
        info = None
        if req.output.prompt_tokens:
            info = PromptInfo(
                token_ids=[ord(c) for c in prompt],
                token_texts=list(prompt),
                logprobs=[None] + [-1.0] * (len(prompt) - 1),
            )
        n, k = req.sampling.max_tokens, req.sampling.logprobs
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            deltas = []
            for seq in range(req.sampling.n):
                char = prompt[i % len(prompt)]
                char = char.upper() if seq else char
                delta = TokenDelta(index=seq, token_ids=[ord(char)], text=char, token_texts=[char])
                delta.logprobs = [-0.25 if seq else -0.5]
                if k:
                    delta.top_logprobs = [[TopLogprob(ord(char), char, delta.logprobs[0])]]
                if i == n - 1:
                    delta.finish_reason = "length"
                if prompt == "eos" and i == n - 1:  # the last token is EOS: no text
                    delta.token_ids, delta.text, delta.token_texts = [EOS], "", ["</s>"]
                    delta.finish_reason = "stop"
                if prompt == "crash-late" and i == 1:
                    raise GenerationFailed("lost the device")
                deltas.append(delta)
            yield Step(deltas=deltas, finished=i == n - 1, prompt_tokens=len(prompt), prompt=info if i == 0 else None)


# One stack for the module (tests/integration/conftest.py); no tokenizer files: the special-id lookup finds none.
pytestmark = pytest.mark.stack(TgiEngine(delay_s=0.001), prefix="scripted-tgi", max_model_len=64,
                               cache_dir="/nonexistent-llmq-cache")


@pytest.fixture(scope="module")
def stack(stack):
    """The module's stack as the (client, url) these tests unpack."""
    return stack.client, stack.url

def _frames(raw: bytes) -> list[bytes]:
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""  # every event ends with a blank line
    return frames[:-1]


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, list[bytes]]:
    async with client.stream("POST", path, json=body) as resp:
        raw = await resp.aread()
    return resp, _frames(raw)


async def test_generate_stream_exact_bytes_no_space_no_done(stack):
    client, _ = stack
    resp, frames = await _stream(
        client, "/generate_stream", {"inputs": "abc", "parameters": {"max_new_tokens": 3, "details": True}}
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert frames == [
        b'data:{"index":1,"token":{"id":97,"text":"a","logprob":-0.5,"special":false},'
        b'"generated_text":null,"details":null}',
        b'data:{"index":2,"token":{"id":98,"text":"b","logprob":-0.5,"special":false},'
        b'"generated_text":null,"details":null}',
        b'data:{"index":3,"token":{"id":99,"text":"c","logprob":-0.5,"special":false},"generated_text":"abc",'
        b'"details":{"finish_reason":"length","generated_tokens":3,"seed":null,"input_length":3}}',
    ]


async def test_eos_token_is_special_and_top_tokens_ride_on_each_event(stack):
    client, _ = stack
    body = {"inputs": "eos", "parameters": {"max_new_tokens": 2, "details": True, "top_n_tokens": 1}}
    _, frames = await _stream(client, "/generate_stream", body)
    events = [json.loads(f.removeprefix(b"data:")) for f in frames]
    assert events[0]["top_tokens"] == [{"id": 101, "text": "e", "logprob": -0.5, "special": False}]
    assert events[-1]["token"] == {"id": EOS, "text": "</s>", "logprob": -0.5, "special": True}
    assert events[-1]["generated_text"] == "e" and events[-1]["details"]["finish_reason"] == "eos_token"


async def test_validation_error_in_a_stream_is_an_event_after_200(stack):
    client, _ = stack
    resp, frames = await _stream(client, "/generate_stream", {"inputs": "x", "parameters": {"top_p": 1.0}})
    assert resp.status_code == 200
    assert frames == [
        b'data:{"error":"Input validation error: `top_p` must be > 0.0 and < 1.0","error_type":"validation"}'
    ]
    resp, frames = await _stream(client, "/", {"inputs": "x", "parameters": {"best_of": 2}, "stream": True})
    assert resp.status_code == 200
    assert json.loads(frames[0].removeprefix(b"data:"))["error"].endswith("not supported when streaming tokens")


async def test_generation_errors_before_and_after_the_first_token_are_in_band(stack):
    client, _ = stack
    resp, frames = await _stream(client, "/generate_stream", {"inputs": "crash", "parameters": {}})
    assert resp.status_code == 200
    assert frames == [
        b'data:{"error":"Request failed during generation: the engine fell over","error_type":"generation"}'
    ]
    _, frames = await _stream(client, "/generate_stream", {"inputs": "crash-late", "parameters": {"max_new_tokens": 5}})
    assert frames[0].startswith(b'data:{"index":1,')
    assert frames[-1] == b'data:{"error":"Request failed during generation: lost the device","error_type":"generation"}'


async def test_keepalive_comments_while_waiting(stack):
    client, _ = stack
    _, frames = await _stream(client, "/generate_stream", {"inputs": "slow", "parameters": {"max_new_tokens": 1}})
    assert frames[0] == b": keep-alive"
    assert json.loads(frames[-1].removeprefix(b"data:"))["generated_text"] == "s"


async def test_generate_object_and_compat_array_with_full_text(stack):
    client, _ = stack
    body = {"inputs": "hey", "parameters": {"max_new_tokens": 4}}
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200 and resp.json() == {"generated_text": "heyh"}
    assert resp.headers["x-generated-tokens"] == "4" and resp.headers["x-prompt-tokens"] == "3"
    resp = await client.post("/", json=body)  # return_full_text defaults to true on the compat route
    assert resp.json() == [{"generated_text": "heyheyh"}]
    resp = await client.post("/", json={**body, "parameters": {**body["parameters"], "return_full_text": False}})
    assert resp.json() == [{"generated_text": "heyh"}]


async def test_details_prefill_and_best_of_sequences(stack):
    client, _ = stack
    params = {"max_new_tokens": 2, "details": True, "decoder_input_details": True, "best_of": 2, "do_sample": True}
    out = (await client.post("/generate", json={"inputs": "ab", "parameters": params})).json()
    assert out["generated_text"] == "AB"  # sequence 1 has the higher cumulative logprob
    d = out["details"]
    assert d["prefill"] == [{"id": 97, "text": "a", "logprob": None}, {"id": 98, "text": "b", "logprob": -1.0}]
    assert [t["text"] for t in d["tokens"]] == ["A", "B"]
    [other] = d["best_of_sequences"]
    assert other["generated_text"] == "ab" and other["generated_tokens"] == 2 and other["prefill"] == d["prefill"]


async def test_http_errors_on_non_streaming_routes(stack):
    client, _ = stack
    resp = await client.post("/generate", json={"inputs": "x", "parameters": {"top_k": 0}})
    assert resp.status_code == 422
    assert resp.json() == {
        "error": "Input validation error: `top_k` must be strictly positive",
        "error_type": "validation",
    }
    resp = await client.post("/generate", json={"inputs": "overload"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    resp = await client.post("/", json={"inputs": "crash"})
    assert resp.status_code == 424 and resp.json()["error_type"] == "generation"
    resp = await client.post("/generate_stream", content=b"{not json")  # unparsable: refused before streaming
    assert resp.status_code == 422 and resp.json()["error_type"] == "validation"


async def test_huggingface_hub_client_maps_our_errors_to_its_classes(stack):
    _, url = stack
    hub = InferenceClient(model=url)

    def call(prompt: str, **kw):
        out = hub.text_generation(prompt, max_new_tokens=2, **kw)
        return list(out) if kw.get("stream") else out

    assert await asyncio.to_thread(call, "hi") == "hihi"
    assert await asyncio.to_thread(call, "hi", return_full_text=False, stream=True) == ["h", "i"]
    with pytest.raises(ValidationError, match="top_p"):
        await asyncio.to_thread(call, "hi", top_p=1.0)
    with pytest.raises(ValidationError, match="top_p"):
        await asyncio.to_thread(call, "hi", top_p=1.0, stream=True)
    with pytest.raises(OverloadedError):
        await asyncio.to_thread(call, "overload")
    with pytest.raises(OverloadedError):
        await asyncio.to_thread(call, "overload", stream=True)
    with pytest.raises(GenerationError):
        await asyncio.to_thread(call, "crash")
