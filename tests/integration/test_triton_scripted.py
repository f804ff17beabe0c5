"""Triton's generate extension on a real port, real Redis and a scripted engine: exact wire bytes.

The scripted engine answers with its prompt's characters cycled (``"abc"`` with ``max_tokens: 4``
gives ``"abca"``), one token per step, so every response and event is known in advance.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_settings, serve_api

SSE = "text/event-stream; charset=utf-8"


pytestmark = pytest.mark.stack(ScriptedEngine(delay_s=0.001), prefix="scripted-triton")  # tests/integration/conftest.py


@pytest.fixture
def client(stack):
    return stack.client


async def raw_stream(client, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    async with client.stream("POST", path, json=body) as resp:
        return resp, await resp.aread()


async def test_generate_prepends_the_prompt_and_echoes_the_id(client):
    body = {"id": "42", "text_input": "abc", "parameters": {"max_tokens": 4, "temperature": 0}}
    resp = await client.post("/v2/models/tiny/generate", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.content == b'{"id":"42","model_name":"tiny","model_version":"1","text_output":"abcabca"}'
    body["parameters"]["exclude_input_in_output"] = True
    resp = await client.post("/v2/models/tiny/versions/1/generate", json=body)
    assert resp.json()["text_output"] == "abca"


async def test_generate_extra_outputs(client):
    body = {
        "text_input": "xy",
        "exclude_input_in_output": True,
        "max_tokens": 3,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    resp = await client.post("/v2/models/tiny/generate", json=body)
    assert resp.content == (
        b'{"finish_reason":"length","model_name":"tiny","model_version":"1",'
        b'"num_input_tokens":2,"num_output_tokens":3,"text_output":"xyx"}'
    )


async def test_generate_stream_sends_delta_events_without_terminator(client):
    body = {
        "id": "s1",
        "text_input": "abc",
        "stream": True,
        "parameters": {"max_tokens": 4, "return_finish_reason": True, "return_num_input_tokens": True},
    }
    resp, raw = await raw_stream(client, "/v2/models/tiny/generate_stream", body)
    assert resp.status_code == 200 and resp.headers["content-type"] == SSE
    event = (
        'data: {"finish_reason":"%s","id":"s1","model_name":"tiny","model_version":"1",'
        '"num_input_tokens":3,"text_output":"%s"}\n\n'
    )
    expected = "".join(event % ("length" if i == 3 else "None", c) for i, c in enumerate("abca"))
    assert raw == expected.encode()


async def test_generate_stream_without_stream_flag_is_one_whole_event(client):
    body = {"text_input": "ab", "parameters": {"max_tokens": 3}}
    resp, raw = await raw_stream(client, "/v2/models/tiny/generate_stream", body)
    assert resp.headers["content-type"] == SSE
    assert raw == b'data: {"model_name":"tiny","model_version":"1","text_output":"ababa"}\n\n'


async def test_stream_deltas_concatenate_to_the_non_streamed_text(client):
    body = {"text_input": "hello", "exclude_input_in_output": True, "parameters": {"max_tokens": 9}}
    full = (await client.post("/v2/models/tiny/generate", json=body)).json()["text_output"]
    _, raw = await raw_stream(client, "/v2/models/tiny/generate_stream", {**body, "stream": True})
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and all(f.startswith(b"data: {") for f in frames[:-1])
    assert "".join(json.loads(f[6:])["text_output"] for f in frames[:-1]) == full == "hellohell"


async def test_error_after_the_first_event_is_in_band_with_status_200(client):
    resp, raw = await raw_stream(client, "/v2/models/tiny/generate_stream", {"text_input": "break", "stream": True})
    assert resp.status_code == 200
    assert raw == (
        b'data: {"model_name":"tiny","model_version":"1","text_output":"b"}\n\n'
        b'data: {"error":"scripted failure mid-stream"}\n\n'
    )


async def test_error_before_the_first_event_is_plain_json_with_its_status(client):
    resp, raw = await raw_stream(client, "/v2/models/tiny/generate_stream", {"text_input": "fail", "stream": True})
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    assert raw == b'{"error":"scripted failure"}'
    resp = await client.post("/v2/models/tiny/generate", json={"text_input": "break"})
    assert resp.status_code == 500 and resp.json() == {"error": "scripted failure mid-stream"}


async def test_bad_requests_are_400_error_objects(client):
    resp = await client.post("/v2/models/tiny/generate", json={"text_input": "x", "parameters": {"foo": 1}})
    assert resp.status_code == 400 and resp.json()["error"].startswith("Unsupported sampling parameter(s): foo.")
    resp = await client.post(
        "/v2/models/tiny/generate_stream", json={"text_input": "x", "stream": True, "exclude_input_in_output": False}
    )
    assert resp.status_code == 400 and "`exclude_input_in_output` = False" in resp.json()["error"]
    resp = await client.post("/v2/models/tiny/generate", content=b"{nope")
    assert resp.status_code == 400 and resp.json()["error"].startswith("Malformed JSON body")


async def test_unknown_models_and_versions_are_404(client):
    resp = await client.post("/v2/models/nope/generate", json={"text_input": "x"})
    assert resp.status_code == 404 and resp.json() == {"error": "Request for unknown model: 'nope' is not found"}
    # the model is looked up before the body is read, as in Triton
    assert (await client.post("/v2/models/nope/generate_stream", content=b"{bad")).status_code == 404
    resp = await client.post("/v2/models/tiny/versions/2/generate", json={"text_input": "x"})
    assert resp.json() == {"error": "Request for unknown model: 'tiny' version 2 is not found"}
    resp = await client.post("/v2/models/tiny/versions/latest/generate", json={"text_input": "x"})
    assert resp.status_code == 404 and resp.json() == {"error": "Not Found"}


async def test_health_and_metadata(client):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready", "/v2/models/tiny/versions/1/ready"):
        resp = await client.get(path)
        assert (resp.status_code, resp.content) == (200, b""), path
    for path in ("/v2/models/nope/ready", "/v2/models/tiny/versions/3/ready"):
        resp = await client.get(path)
        assert (resp.status_code, resp.json()) == (400, {"error": "Model version not ready"}), path
    assert (await client.get("/v2/models/tiny/versions/x/ready")).status_code == 404
    server = (await client.get("/v2")).json()
    assert server["name"] == "llmq" and "generate" in server["extensions"]
    meta = (await client.get("/v2/models/tiny")).json()
    assert (meta["name"], meta["versions"], meta["platform"]) == ("tiny", ["1"], "vllm")
    assert meta["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert {o["name"] for o in meta["outputs"]} >= {"text_output", "finish_reason", "num_output_tokens"}
    assert (await client.get("/v2/models/tiny/versions/1")).json() == meta
    resp = await client.get("/v2/models/nope")
    assert resp.status_code == 404 and resp.json() == {"error": "Request for unknown model: 'nope' is not found"}


async def test_a_model_without_a_warm_worker_is_not_ready_and_its_request_waits_its_cold_wait(stack, redis_url):
    ghost = scripted_settings(redis_url, "scripted-triton-ghost", served_model_name="ghost", cold_wait_s=1.0)
    async with serve_api(ghost) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/v2/health/live")).status_code == 200
            resp = await http.get("/v2/health/ready")
            assert (resp.status_code, resp.content) == (400, b"")
            assert (await http.get("/v2/models/ghost/ready")).status_code == 400
            assert (await http.get("/v2/models/ghost")).status_code == 200  # configured, so known
            # Queued, not refused: with no worker coming, its cold wait ends it as Triton ends a
            # request whose queue timeout expired (UNAVAILABLE).
            resp = await http.post("/v2/models/ghost/generate", json={"text_input": "x"})
            assert resp.status_code == 503, resp.text
            assert "no worker became ready" in resp.json()["error"]
