"""Events that carry several engine steps' tokens (merged in the worker while its flusher was
busy, workers/attempt.py merge_tokens) read back through the API as the steps would: every token
once, the text and logprobs whole, seqs 1..n, and a resume from any seq the rest, byte for byte.
The engine here steps with no delay, so a flush nearly always finds several steps of a job."""

from __future__ import annotations

import json

import pytest

from tests.support.event_log import read_job_sse, sse_frames
from tests.support.scripted_engine import ScriptedEngine, expected_text

pytestmark = pytest.mark.stack(ScriptedEngine(delay_s=0.0), prefix="merged")  # tests/integration/conftest.py

PROMPT = "merge my steps"


async def test_merged_events_read_back_token_for_token_and_resume_at_every_seq(stack):
    tokens = 200
    resp = await stack.client.post("/v1/completions", headers={"Prefer": "respond-async"},
                                   json={"prompt": PROMPT, "max_tokens": tokens, "logprobs": 1})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    live = sse_frames(await read_job_sse(stack.client, job_id))
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in live]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert len(events) < tokens  # merged: fewer events than tokens (the control is every other test's stream)
    deltas = [d for e in events for d in e.get("deltas", [])]
    assert "".join(d.get("text", "") for d in deltas) == expected_text(PROMPT, tokens)
    assert sum(len(d["token_ids"]) for d in deltas) == tokens
    assert sum(len(d["logprobs"]) for d in deltas) == sum(len(d["token_texts"]) for d in deltas) == tokens
    for after in range(0, len(live)):
        assert sse_frames(await read_job_sse(stack.client, job_id, after)) == live[after:], after
