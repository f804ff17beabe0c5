"""Per-tenant series in ``GET /metrics`` and the top tenants in ``llmq-status``, on the real app, a
real worker (scripted engine: a job's prompt tokens are its prompt's characters, its generated
tokens its max_tokens) and real Redis, with tenants named by the ``x-tenant`` header."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from shared.keys import Keys
from shared.status import render, snapshot
from tests.conftest import REPO
from tests.support.job_records import MODEL, wait_status
from tests.support.metrics import samples
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack

HEADER = "x-tenant"
COUNTERS = ("llmq_tenant_requests_total", "llmq_tenant_prompt_tokens_total", "llmq_tenant_generated_tokens_total")
GAUGES = ("llmq_tenant_waiting_jobs", "llmq_tenant_running_jobs")


async def complete(client, tenant: str, prompt: str, max_tokens: int, times: int = 1) -> None:
    for _ in range(times):
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens},
                                 headers={HEADER: tenant})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                                        "total_tokens": len(prompt) + max_tokens}


def per_tenant(values: dict) -> dict[str, dict[str, float]]:
    """tenant -> {series name: value} for the model's per-tenant series."""
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in values.items():
        labels = dict(labels)
        if name.startswith("llmq_tenant_"):
            assert labels.keys() == {"model", "tenant"} and labels["model"] == MODEL, labels
            out.setdefault(labels["tenant"], {})[name] = value
    return out


async def engine_seconds(redis, prefix: str, *tenants: str) -> float:
    """What the usage hash holds for these tenants' engine time (it is a measured time)."""
    values = await redis.hmget(Keys(prefix).usage(MODEL), [f"{t}:engine_ms" for t in tenants])
    assert all(values), values
    return sum(int(v) for v in values) / 1000


async def test_each_tenant_has_exact_counters_gauges_and_a_rank_in_status(redis_url, prefix):
    engine = ScriptedEngine(delay_s=0.002)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1, tenant_header=HEADER) as s:
        # First seen in this order; by tokens team-b (54) > team-c (18) > team-a (5).
        await complete(s.client, "team-a", "ab", 3)
        await complete(s.client, "team-b", "abcdefgh", 10, times=3)
        await complete(s.client, "team-c", "abcd", 5, times=2)

        resp = await s.client.get("/metrics")
        assert resp.status_code == 200
        text = resp.text
        for name in (*COUNTERS, "llmq_tenant_engine_seconds_total"):
            assert f"# TYPE {name} counter" in text
        for name in GAUGES:
            assert f"# TYPE {name} gauge" in text
        tenants = per_tenant(samples(text))
        assert set(tenants) == {"team-a", "team-b", "team-c"}  # under the cap of 50: no "other"
        expected = {"team-a": (1, 2, 3), "team-b": (3, 24, 30), "team-c": (2, 8, 10)}
        for tenant, figures in expected.items():
            assert tuple(tenants[tenant][c] for c in COUNTERS) == figures, tenant
            seconds = tenants[tenant]["llmq_tenant_engine_seconds_total"]
            assert seconds == await engine_seconds(s.redis, prefix, tenant) and seconds > 0
            assert [tenants[tenant][g] for g in GAUGES] == [0, 0]

        # llmq-status, as an operator runs it: today's tenants ranked by tokens, not by arrival.
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "shared.status", "--url", redis_url, "--prefix", prefix, "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
        [model] = json.loads(out.stdout)["models"]
        assert [(t["tenant"], t["requests"], t["prompt_tokens"], t["generated_tokens"])
                for t in model["top_tenants"]] == [("team-b", 3, 24, 30), ("team-c", 2, 8, 10), ("team-a", 1, 2, 3)]
        assert all(t["engine_seconds"] > 0 for t in model["top_tenants"])
        status = await snapshot(s.redis, Keys(prefix))
        text = render(status)
        assert f"top tenants of {status.day} (UTC), by tokens:" in text
        rows = [line.split() for line in text.splitlines() if line.strip().startswith("team-")]
        assert [row[:4] for row in rows] == [["team-b", "3", "24", "30"], ["team-c", "2", "8", "10"],
                                             ["team-a", "1", "2", "3"]]

        # The gauges: team-c's first job holds the one engine slot (for 100 s: until cancelled), its
        # second waits its turn.
        engine.delay_s = 0.05
        ids = []
        for _ in range(2):
            resp = await s.client.post("/v1/jobs", json={"prompt": "hold", "sampling": {"max_tokens": 2000}},
                                       headers={HEADER: "team-c"})
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["id"])
            await wait_status(s.redis, prefix, ids[0], {"running"})  # the first one before the second comes
        assert (await s.redis.hget(Keys(prefix).job(MODEL, ids[1]), "status")) == b"queued"
        tenants = per_tenant(samples((await s.client.get("/metrics")).text))
        assert {t: [tenants[t][g] for g in GAUGES] for t in expected} == {
            "team-a": [0, 0], "team-b": [0, 0], "team-c": [1, 1]}
        for job_id in ids:
            assert (await s.client.delete(f"/v1/jobs/{job_id}")).status_code == 200


async def test_tenants_past_the_cap_are_summed_under_other_and_never_named(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.002), tenant_header=HEADER,
                              metrics_tenants=2) as s:
        # First seen: team-a, a tenant really named "other" (never labelled: its series would
        # mean two things), team-b, team-d. The cap of 2 labels team-a and team-b.
        await complete(s.client, "team-a", "ab", 3)
        await complete(s.client, "other", "abc", 4)
        await complete(s.client, "team-b", "abcd", 5, times=2)
        await complete(s.client, "team-d", "abcdefgh", 6)

        text = (await s.client.get("/metrics")).text
        assert "team-d" not in text
        tenants = per_tenant(samples(text))
        assert set(tenants) == {"team-a", "team-b", "other"}
        assert {t: tuple(tenants[t][c] for c in COUNTERS) for t in tenants} == {
            "team-a": (1, 2, 3), "team-b": (2, 8, 10), "other": (1 + 1, 3 + 8, 4 + 6)}
        assert tenants["other"]["llmq_tenant_engine_seconds_total"] == await engine_seconds(
            s.redis, prefix, "other", "team-d")
        # Gauges only for the labelled tenants: "other" would cost one read per tenant.
        assert [t for t in tenants if any(g in tenants[t] for g in GAUGES)] == ["team-a", "team-b"]

        # A newcomer joins "other"; the labels stay where they were, so every series only grew.
        await complete(s.client, "team-e", "ab", 2)
        text = (await s.client.get("/metrics")).text
        assert "team-d" not in text and "team-e" not in text
        tenants = per_tenant(samples(text))
        assert {t: tuple(tenants[t][c] for c in COUNTERS) for t in tenants} == {
            "team-a": (1, 2, 3), "team-b": (2, 8, 10), "other": (3, 13, 12)}
