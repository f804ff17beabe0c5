"""A worker whose flusher lags its engine (each flush late: tests/support/flush_lag.py), on real
Redis through the API: a job whose dialect renders text deltas gets fewer events than engine
steps (its steps share the event still in the outbox), read back as the steps would be: every
token once, the text whole, seqs 1..n, and a resume from any seq the rest, byte for byte. A
per-token dialect's stream (TGI, LMI, Triton) is byte for byte what it is when the flusher keeps up.
Each lagging run has its control: the same request with the flusher on time."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.event_log import read_job_sse, sse_frames
from tests.support.flush_lag import flush_lag
from tests.support.scripted_engine import ScriptedEngine, expected_text

pytestmark = pytest.mark.stack(ScriptedEngine(delay_s=0.001), prefix="merged")  # tests/integration/conftest.py

PROMPT = "merge my steps"
TOKENS = 60
LAG_S = 0.05  # ~50 engine steps of 1 ms behind


async def job_events(client: httpx.AsyncClient, body: dict) -> tuple[str, list[bytes]]:
    """An async job's id and its events as its SSE stream sent them, frame by frame."""
    resp = await client.post("/v1/completions", headers={"Prefer": "respond-async"}, json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    return job_id, sse_frames(await read_job_sse(client, job_id))


def decoded(frames: list[bytes]) -> list[dict]:
    return [json.loads(f.split(b"data: ", 1)[1]) for f in frames]


async def test_a_delta_dialects_steps_share_events_and_read_back_token_for_token(stack):
    body = {"prompt": PROMPT, "max_tokens": TOKENS}
    with flush_lag(0):
        _, control = await job_events(stack.client, body)
    with flush_lag(LAG_S):
        job_id, live = await job_events(stack.client, body)
    for events in (decoded(control), decoded(live)):
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        deltas = [d for e in events for d in e.get("deltas", [])]
        assert "".join(d.get("text", "") for d in deltas) == expected_text(PROMPT, TOKENS)
        assert [t for d in deltas for t in d["token_ids"]] == [ord(c) for c in expected_text(PROMPT, TOKENS)]
    # On time, the flusher takes nearly every step alone; lagging, several steps an event.
    assert len(live) < TOKENS // 4 < len(control), (len(live), len(control))
    # The log (its compact form once the job ended) holds the same events: a resume from any seq.
    for after in range(len(live)):
        assert sse_frames(await read_job_sse(stack.client, job_id, after)) == live[after:], after


async def sse_stream(client: httpx.AsyncClient, path: str, body: dict) -> bytes:
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        return await resp.aread()


async def test_an_openai_stream_has_fewer_chunks_and_the_same_text(stack):
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    with flush_lag(0):
        control = await sse_stream(stack.client, "/v1/completions", body)
    with flush_lag(LAG_S):
        lagged = await sse_stream(stack.client, "/v1/completions", body)

    def chunks(raw: bytes) -> list[dict]:
        return [json.loads(f[6:]) for f in sse_frames(raw) if f != b"data: [DONE]\n\n"]

    for raw in (control, lagged):
        assert "".join(c["text"] for chunk in chunks(raw) for c in chunk["choices"]) == expected_text(PROMPT, TOKENS)
        assert chunks(raw)[-1]["usage"]["completion_tokens"] == TOKENS and raw.endswith(b"data: [DONE]\n\n")
    assert len(chunks(lagged)) < len(chunks(control)) // 4


PER_TOKEN = [
    ("tgi", "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "details": True}}),
    ("lmi", "/invocations", {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "details": True},
                             "stream": True}),
    ("triton", "/v2/models/tiny/generate_stream",
     {"text_input": PROMPT, "stream": True, "parameters": {"max_tokens": TOKENS, "return_num_output_tokens": True}}),
]


@pytest.mark.parametrize(("dialect", "path", "body"), PER_TOKEN, ids=[p[0] for p in PER_TOKEN])
async def test_a_per_token_dialects_stream_is_the_same_when_the_flusher_lags(stack, dialect, path, body):
    with flush_lag(0):
        control = await sse_stream(stack.client, path, body)
    with flush_lag(LAG_S):
        lagged = await sse_stream(stack.client, path, body)
    assert lagged == control
    assert len([line for line in control.split(b"\n") if line.strip()]) >= TOKENS  # a line per token (or step)
