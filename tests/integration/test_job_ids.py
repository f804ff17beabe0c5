"""A job id names its model: ``GET /v1/jobs/{id}`` reads one model's keys, not every known one.

The real app and a scripted worker for "tiny" on real Redis; the deployment also knows four
other models (``LLMQ_MODELS``), whose jobs queue with no worker up.
"""

from __future__ import annotations

import pytest

from shared.keys import TAG_CHARS, Keys, model_tag
from shared.queue import JobStore
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.support.job_records import wait_status
from tests.support.scripted_stack import scripted_stack

OTHERS = ("a", "b", "c", "last")


async def _reads(redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {cmd: stats.get(f"cmdstat_{cmd}", {}).get("calls", 0) for cmd in ("hgetall", "get", "hmget")}


@pytest.mark.parametrize("model", ["tiny", "last"])
async def test_a_poll_reads_only_its_models_record(redis_url, prefix, model):
    async with scripted_stack(redis_url, prefix, models=",".join(OTHERS)) as s:
        resp = await s.client.post("/v1/completions", json={"model": model, "prompt": "p", "max_tokens": 1},
                                   headers={"Prefer": "respond-async"})
        job_id = resp.json()["id"]
        assert len(job_id) == 32 and job_id[:TAG_CHARS] == model_tag(model)
        if model == "tiny":  # let its worker finish it first: the worker reads records too
            await wait_status(s.redis, s.settings.prefix, job_id, {"done"})
        await s.redis.config_resetstat()
        view = await s.client.get(f"/v1/jobs/{job_id}")
        after = await _reads(s.redis)
        assert view.status_code == 200 and view.json()["model"] == model
        # One record read, and for a job still queued (no worker serves the other models) its
        # standing: a few fields of the same record (JobStore.position); nothing under the other
        # models' keys.
        assert after == {"hgetall": 1, "get": 0, "hmget": 0 if model == "tiny" else 1}, after


async def test_an_id_without_its_models_tag_is_still_found(redis_url, prefix):
    """Jobs queued before ids carried their model's tag stay readable after an upgrade."""
    async with scripted_stack(redis_url, prefix, models=",".join(OTHERS)) as s:
        queue = JobStore(s.redis, Keys(s.settings.prefix))
        req = GenerationRequest(model="last", prompt="p", sampling=SamplingParams(max_tokens=1), priority=0)
        old_id = "0" * TAG_CHARS + "f" * (32 - TAG_CHARS)  # a tag no model here has
        assert all(model_tag(m) != old_id[:TAG_CHARS] for m in ("tiny", *OTHERS))
        await queue.enqueue(JobRecord(id=old_id, model="last", request=req, queued_at=1.0))
        view = await s.client.get(f"/v1/jobs/{old_id}")
        assert view.status_code == 200 and view.json()["id"] == old_id
        missing = await s.client.get(f"/v1/jobs/{'0' * TAG_CHARS}{'e' * (32 - TAG_CHARS)}")
        assert missing.status_code == 404
