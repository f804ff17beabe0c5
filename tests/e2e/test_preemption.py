"""Preemption on real vLLM (docs/tenants.md#preemption): a light tenant's first token under a
flood of long jobs comes within a step or two of its time alone, not after the flood's batch
turns over, and the flood pays little for it.

One worker of 64 slots (its own stack: one worker, one API, tenants by a gateway's header).
Tenant ``heavy`` queues 128 greedy jobs of 1,024 tokens at once (fire-and-poll), two batches'
worth, about ten seconds each here; while they run, tenant ``light`` sends one short streamed
request a second with the openai SDK. The same flood runs before and after without the light
tenant (nothing is preempted then): the reference for the flood's event streams, which must be
byte-identical, and for its throughput. Measured here (the tiny model, float32, batches of 64),
the greedy streams of the three floods agreed to the last of their 1,024 tokens.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.support.event_log import logged_events
from tests.support.fair_share import HEADER, ttft_s
from tests.support.real_processes import one_worker
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e]

SLOTS = 64
FLOOD = 2 * SLOTS
TOKENS = 1024


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Redis, Keys]]:
    prefix = f"preempt-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": str(SLOTS), "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_TENANT_HEADER": HEADER}
    with one_worker(env, tmp_path_factory.mktemp("preempt-logs")) as url, Redis.from_url(redis_url) as redis:
        yield url, redis, Keys(prefix)


def flood(url: str, redis: Redis, keys: Keys, model: str, client: openai.OpenAI | None = None
          ) -> tuple[dict[str, str], float, list[float]]:
    """The heavy tenant's flood, queued at once (one request of 128 prompts, fire-and-poll): per
    prompt the text its job's event stream carried; the seconds from its queueing to its last job's
    end; and (with a client) the light tenant's TTFTs meanwhile, one a second."""
    prompts = [f"Story {i}: once upon a time" for i in range(FLOOD)]
    with httpx.Client(base_url=url, timeout=60, headers={HEADER: "heavy"}) as http:
        resp = http.post("/v1/completions", json={"model": model, "prompt": prompts, "max_tokens": TOKENS,
                                                   "temperature": 0, "ignore_eos": True},
                         headers={"Prefer": "respond-async"})
        assert resp.status_code == 202, resp.text
        job_ids = http.get(f"/v1/jobs/{resp.json()['id']}").json()["jobs"]

    def ended() -> bool:
        return all(s in (b"done", b"failed") for s, in (redis.hmget(keys.job(model, j), "status") for j in job_ids))

    probes = []
    time.sleep(1.0)  # the first batch running, past LLMQ_PREEMPT_MIN_RUN_MS
    while client is not None and redis.hget(keys.job(model, job_ids[-SLOTS // 2]), "status") != b"done":
        sent = time.monotonic()
        probes.append(ttft_s(client, model, "light"))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - sent)))
    eventually_sync(ended, timeout_s=300, interval_s=0.2, what="the flood to end")
    texts = {}
    for prompt, job_id in zip(prompts, job_ids, strict=True):
        events = [e for _, e in logged_events(redis, keys, model, job_id)]
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1)) and events[-1]["type"] == "done"
        texts[prompt] = "".join(d.get("text", "") for e in events for d in e.get("deltas", ()))
    times = [redis.hmget(keys.job(model, j), "queued_at", "finished_at") for j in job_ids]
    return texts, (max(float(f) for _, f in times) - min(float(q) for q, _ in times)) / 1000, probes


def test_a_light_tenants_ttft_under_a_flood_is_a_step_or_two_from_its_ttft_alone(stack):
    url, redis, keys = stack
    model = load_settings({}).model_name
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    alone = statistics.median(ttft_s(client, model, "light") for _ in range(5))

    reference, before_s, _ = flood(url, redis, keys, model)
    streams, contended_s, probes = flood(url, redis, keys, model, client)
    _, after_s, _ = flood(url, redis, keys, model)
    usage = redis.hgetall(keys.usage(model))
    preemptions = int(usage.get(b"heavy:preemptions", 0))
    turnover = before_s / 2 * 1000  # two batches' worth: each batch's jobs start and end together
    ratio = contended_s / statistics.median([before_s, after_s])
    p50, worst = (statistics.median(probes), max(probes)) if probes else (float("nan"), float("nan"))
    print(f"light TTFT alone {alone * 1000:.0f} ms; under the flood p50 {p50 * 1000:.0f} ms, "
          f"max {worst * 1000:.0f} ms ({len(probes)} probes); a flood job runs {turnover / 1000:.1f} s; "
          f"flood {before_s:.1f} s / {contended_s:.1f} s with the light tenant / {after_s:.1f} s "
          f"(x{ratio:.3f}); {preemptions} preemptions")

    assert len(probes) >= 3 and turnover >= 2000, f"the flood's jobs hold their slots for seconds: {turnover} ms"
    assert p50 <= alone + 0.1
    assert worst <= alone + 0.5
    assert preemptions >= len(probes) // 2, "the light tenant's jobs took slots by preemption"
    for prompt, text in streams.items():
        ref = reference[prompt]
        at = next((i for i, (a, b) in enumerate(zip(text, ref, strict=False)) if a != b), min(len(text), len(ref)))
        assert text == ref, f"{prompt!r} differs from character {at} on"
    assert ratio <= 1.10, "the flood lost more than 10 % of its throughput"
