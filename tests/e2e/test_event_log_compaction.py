"""A finished job's compacted event log on real vLLM: real token texts, logprobs and top
logprobs (floats), the prompt's tokens, a real Done; a resume after the end reads exactly what
the live stream carried (tests/integration/test_event_log_compaction.py runs the same on a
scripted engine, at every resume point and size)."""

from __future__ import annotations

import time

import httpx
import pytest
from redis import Redis

from shared import eventlog
from shared.keys import Keys
from tests.support.event_log import logged_events

pytestmark = pytest.mark.e2e


def frames(raw: bytes) -> list[bytes]:
    """An SSE body's event frames (keep-alive comments dropped)."""
    return [f for f in raw.split(b"\n\n") if f.startswith(b"id: ")]


def test_a_resume_after_the_end_reads_the_compact_log_byte_for_byte(stack):
    body = {"prompt": "Compact me", "output": {"prompt_tokens": True},
            "sampling": {"max_tokens": 48, "temperature": 0.8, "seed": 7, "ignore_eos": True,
                         "logprobs": 2, "prompt_logprobs": 1}}
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        created = client.post("/v1/jobs", json=body)
        assert created.status_code in (200, 201, 202), created.text
        job_id = created.json()["id"]

        def read(after: int | None) -> list[bytes]:
            headers = {} if after is None else {"Last-Event-ID": str(after)}
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
                assert resp.status_code == 200
                return frames(resp.read())

        live = read(None)  # followed from the start, while it runs
        assert [int(f.split(b"\n")[0][4:]) for f in live] == list(range(1, len(live) + 1))
        assert b'"type":"done"' in live[-1] and b'"logprobs"' in live[1]
        redis = Redis.from_url(stack.redis_url)
        keys = Keys(stack.prefix)
        log_key = keys.events(stack.model, job_id)
        try:
            # The compact log is a field of the record; the stream goes just after the record took
            # it (the end is logged, then the record says it, then the token shard is settled).
            deadline = time.monotonic() + 5
            while redis.exists(log_key) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not redis.exists(log_key)
            compact = redis.hget(keys.job(stack.model, job_id), "log")
            # Rebuilt from the stored result: real logprobs and texts survive the round trip.
            assert compact[:1] == eventlog.SHAPE, compact[:1]
            assert len(compact) <= 1024
            assert not redis.hexists(keys.job(stack.model, job_id), "prompt_ids")  # continuation only
            assert [seq for seq, _ in logged_events(redis, keys, stack.model, job_id)] == list(
                range(1, len(live) + 1))
        finally:
            redis.close()
        for after in range(len(live)):
            assert read(after) == live[after:], after
