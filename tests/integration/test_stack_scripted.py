"""The whole queue path on a real port, real Redis and a scripted engine: exact wire bytes.

The engine's tokens are known in advance, so these tests can pin framing byte for byte. The
same paths run on real vLLM in tests/e2e.
"""

from __future__ import annotations

import json

import pytest

from tests.support.scripted_engine import expected_text

pytestmark = pytest.mark.stack(prefix="scripted")  # one stack for the module: tests/integration/conftest.py


@pytest.fixture(scope="module")
def stack(stack):
    """The module's stack as the (client, redis, settings) these tests unpack."""
    return stack.client, stack.redis, stack.settings

async def test_lmi_jsonlines_frames_one_token_per_line_and_summary_last(stack):
    client, _, _ = stack
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "details": True}, "stream": True}
    async with client.stream("POST", "/invocations", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("application/jsonlines")
        raw = await resp.aread()
    lines = raw.split(b"\n")
    assert lines[-1] == b""  # every line ends with a newline
    objs = [json.loads(x) for x in lines[:-1]]
    assert [o["token"]["text"] for o in objs] == ["a", "b", "c", "a"]
    assert [o["token"]["id"] for o in objs] == [97, 98, 99, 97]
    assert all("generated_text" not in o for o in objs[:-1])
    assert objs[-1]["generated_text"] == "abca"
    assert objs[-1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "inputs": "abc"}


async def test_lmi_non_streaming_matches_stream_and_has_details_tokens(stack):
    client, _, _ = stack
    body = {"inputs": "xyz", "parameters": {"max_new_tokens": 5, "details": True, "return_full_text": True}}
    resp = await client.post("/invocations", json=body)
    assert resp.status_code == 200
    out = resp.json()
    assert out["generated_text"] == "xyz" + expected_text("xyz", 5)
    assert out["details"]["generated_tokens"] == 5
    assert [t["text"] for t in out["details"]["tokens"]] == list(expected_text("xyz", 5))
    assert out["details"]["tokens"][0] == {"id": 120, "text": "x", "log_prob": -0.5}


async def test_openai_stream_is_sse_with_space_and_done_terminator(stack):
    client, _, _ = stack
    body = {"prompt": "hey", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = await resp.aread()
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-2] if not f.startswith(b":")]
    # One chunk per token event: as many as the job had events (shared/chunking.py), the last one's
    # with the finish reason.
    *pieces, last = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(p["text"] for p in [*pieces, last]) == "hey"
    assert [p["finish_reason"] for p in pieces] == [None] * len(pieces) and last["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "text_completion"


async def test_models_list_is_openais_shape_with_vllms_extras(stack):
    client, _, settings = stack
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    # The served name "tiny" is the configured model's alias: its root is the model itself.
    card = (f'{{"id":"tiny","object":"model","created":0,"owned_by":"llmq","root":"{settings.model}",'
            f'"parent":null,"max_model_len":{settings.max_model_len},"input_modalities":["text"],"kind":"generate"}}')
    assert resp.content == f'{{"object":"list","data":[{card}]}}'.encode()


async def test_error_before_first_token_gets_real_status(stack):
    client, _, _ = stack
    resp = await client.post("/v1/completions", json={"prompt": "fail", "max_tokens": 3, "stream": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "scripted failure"
    resp = await client.post("/invocations", json={"inputs": "fail"})
    assert resp.status_code == 424 and resp.json() == {"error": "scripted failure", "code": 424}


async def test_job_events_resume_after_last_event_id(stack):
    client, _, _ = stack
    resp = await client.post("/v1/completions", json={"prompt": "resume", "max_tokens": 6},
                             headers={"Prefer": "respond-async"})
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    assert resp.headers["location"] == f"/v1/jobs/{job_id}"

    async def events(headers: dict[str, str]) -> list[tuple[int, dict]]:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
            raw = (await r.aread()).decode()
        out = []
        for frame in raw.split("\n\n"):
            if frame.startswith("id: "):
                id_line, data_line = frame.split("\n")
                out.append((int(id_line[4:]), json.loads(data_line.removeprefix("data: "))))
        return out

    full = await events({})
    assert [seq for seq, _ in full] == list(range(1, len(full) + 1))
    assert full[-1][1]["type"] == "done"
    resumed = await events({"Last-Event-ID": "3"})
    assert resumed == full[3:]
    for bad in ("x", "-1", str(2**63), "9" * 30):  # never a stream that breaks after its 200
        resp = await client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "Last-Event-ID", (bad, resp.text)
    for bad in ("١٢", "³", " 3", "+3"):  # ASCII digits only: int() would read the first as 12
        resp = await client.get(f"/v1/jobs/{job_id}/events", params={"after": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "Last-Event-ID", (bad, resp.text)

    job = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["status"] == "done"
    assert job["result"]["choices"][0]["text"] == expected_text("resume", 6)
    assert job["result"]["object"] == "text_completion"


async def test_unknown_job_is_404_and_bad_bodies_get_dialect_errors(stack):
    client, _, _ = stack
    assert (await client.get("/v1/jobs/nope")).status_code == 404
    assert (await client.get("/v1/jobs/nope/events")).status_code == 404
    resp = await client.post("/invocations", content=b"{not json")
    assert resp.status_code == 424 and resp.json()["code"] == 424
    resp = await client.post("/invocations", json={"inputs": "x", "parameters": {"top_p": 1.5}})
    assert resp.status_code == 424 and "top_p" in resp.json()["error"]
    resp = await client.post("/v1/completions", json={"prompt": 5})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
    assert resp.status_code == 404


async def test_invocations_dispatches_on_body_keys(stack):
    client, _, _ = stack
    resp = await client.post("/invocations", json={"prompt": "abc", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["object"] == "text_completion"
    assert resp.json()["choices"][0]["text"] == "ab"
    resp = await client.post("/invocations", json={"prompt": 5})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["object"] == "chat.completion"
    assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": "hih"}
    resp = await client.post("/invocations", json={"messages": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/predictions/tiny", json={"inputs": "ab", "parameters": {"max_new_tokens": 3}})
    assert resp.json() == {"generated_text": "aba"}
    assert (await client.post("/predictions/other", json={"inputs": "ab"})).status_code == 404


async def test_repeated_idempotency_key_follows_the_first_job(stack):
    client, _, _ = stack
    body = {"prompt": "idem", "max_tokens": 4}
    headers = {"Idempotency-Key": "same-key"}
    first = (await client.post("/v1/completions", json=body, headers=headers)).json()
    again = (await client.post("/v1/completions", json={**body, "max_tokens": 9}, headers=headers)).json()
    assert again["id"] == first["id"] and again["choices"][0]["text"] == first["choices"][0]["text"] == "idem"
