"""happy_vllm's legacy generate on a real port, real Redis and a scripted engine: exact wire bytes.

The scripted engine answers with its prompt's characters cycled (``"abc"`` with ``max_tokens: 4``
gives ``"abca"``), one token per step, so every line of the cumulative stream is known in advance.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_settings, serve_api
from tests.support.streams import chunked

pytestmark = pytest.mark.stack(ScriptedEngine(delay_s=0.001), prefix="scripted-happy")  # tests/integration/conftest.py


@pytest.fixture(scope="module")
def client(stack):
    return stack.client


async def raw_stream(client, body: dict) -> tuple[httpx.Response, bytes]:
    async with client.stream("POST", "/v1/generate_stream", json=body) as resp:
        return resp, await resp.aread()


async def test_generate_body_bytes(client):
    resp = await client.post("/v1/generate", json={"prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.content == (
        b'{"responses":["abca"],"finish_reasons":["length"],'
        b'"usages":[{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}]}'
    )
    resp = await client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 1, "prompt_in_response": True})
    assert resp.json()["prompt"] == "ab" and list(resp.json())[-1] == "prompt"


async def test_generate_stream_is_ndjson_with_cumulative_text_and_the_string_None(client):
    resp, raw = await raw_stream(client, {"prompt": "abc", "max_tokens": 4})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-ndjson"
    line = (
        '{"responses": ["%s"], "finish_reasons": ["%s"], '
        '"usages": [{"prompt_tokens": 3, "completion_tokens": %d, "total_tokens": %d}]}\n'
    )
    # One line per event, each the whole answer so far: the lines expected are rendered from the
    # pieces each added (as many as the job had events).
    answers = [json.loads(x)["responses"][0] for x in raw.splitlines()]
    pieces = chunked([b.removeprefix(a) for a, b in zip(["", *answers], answers, strict=False)], "abca")
    ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
    expected = "".join(line % ("abca"[:end], "length" if end == 4 else "None", end, end + 3) for end in ends)
    assert raw == expected.encode()


async def test_last_stream_line_equals_the_non_streamed_response(client):
    body = {"prompt": "hello", "max_tokens": 7, "prompt_in_response": True}
    full = (await client.post("/v1/generate", json=body)).json()
    _, raw = await raw_stream(client, body)
    lines = [json.loads(x) for x in raw.splitlines()]
    assert (
        lines[-1]
        == full
        == {
            "responses": ["hellohe"],
            "finish_reasons": ["length"],
            "usages": [{"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}],
            "prompt": "hello",
        }
    )
    answers = [x["responses"][0] for x in lines]  # each the one before and more, as many as the job had events
    chunked([b.removeprefix(a) for a, b in zip(["", *answers], answers, strict=False)], "hellohe")
    assert all(b.startswith(a) for a, b in zip(answers, answers[1:], strict=False))


async def test_errors_before_the_first_line_get_a_real_status(client):
    resp, raw = await raw_stream(client, {"prompt": "fail", "max_tokens": 2})
    assert resp.status_code == 422 and json.loads(raw) == {"detail": "scripted failure"}
    resp = await client.post("/v1/generate", json={"prompt": "break"})
    assert resp.status_code == 500 and resp.json() == {"detail": "scripted failure mid-stream"}


async def test_error_after_the_first_line_ends_the_stream_with_a_detail_line(client):
    resp, raw = await raw_stream(client, {"prompt": "break"})
    assert resp.status_code == 200
    assert raw == (
        b'{"responses": ["b"], "finish_reasons": ["None"], '
        b'"usages": [{"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}]}\n'
        b'{"detail": "scripted failure mid-stream"}\n'
    )


async def test_invalid_bodies_are_422_detail(client):
    cases = [
        ({"max_tokens": 3}, "field required: `prompt`"),
        (
            {"prompt": "x", "response_pool": ["a"], "json_format": {"a": "string"}},
            "Two keywords are incompatible : response_pool and json_format",
        ),
        (
            {"prompt": "x", "response_pool": ["a"], "min_tokens": 1},
            "min_tokens : 1 is incompatible with the `response_pool` keyword",
        ),
        (
            {"prompt": "x", "temperature": -1},
            "Invalid sampling parameter: Expected `float` >= 0.0 - at `$.temperature`",
        ),
    ]
    for body, detail in cases:
        resp = await client.post("/v1/generate", json=body)
        assert (resp.status_code, resp.json()) == (422, {"detail": detail}), body
    resp = await client.post("/v1/generate_stream", json={"prompt": "x", "use_beam_search": True})
    assert resp.status_code == 422 and resp.json()["detail"].startswith("Unsupported sampling parameter(s)")
    resp = await client.post("/v1/generate", content=b"[1]")
    assert resp.status_code == 422 and "Expected `object`" in resp.json()["detail"]


async def test_technical_routes(client):
    assert (await client.get("/liveness")).json() == {"alive": "ok"}
    resp = await client.get("/readiness")
    assert (resp.status_code, resp.json()) == (200, {"ready": "ok"})
    info = (await client.get("/v1/info")).json()
    assert set(info) == {"application", "version", "vllm_version", "model_name", "truncation_side", "max_length"}
    assert info["model_name"] == "tiny" and info["application"] == "llmq"


async def test_readiness_is_ko_with_200_when_no_worker_serves_the_model(redis_url):
    ghost = scripted_settings(redis_url, "scripted-happy-ghost", served_model_name="ghost", cold_wait_s=1.0)
    async with serve_api(ghost) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            resp = await http.get("/readiness")
            assert (resp.status_code, resp.json()) == (200, {"ready": "ko"})
            # Queued, not refused; with no worker coming its cold wait runs out: 504.
            resp = await http.post("/v1/generate", json={"prompt": "x"})
            assert resp.status_code == 504 and "LLMQ_COLD_WAIT_S" in resp.json()["detail"]
