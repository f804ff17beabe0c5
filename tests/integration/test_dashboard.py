"""The Grafana dashboard in deploy/grafana: its JSON is what the code in dashboard.py builds, and
every query names only series a live /metrics serves (the real app, real Redis, a worker with a
scripted engine, after a job of a tenant and an error answer)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

from tests.conftest import REPO
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack

DASHBOARD = REPO / "deploy" / "grafana"


def _module():
    spec = importlib.util.spec_from_file_location("llmq_dashboard", DASHBOARD / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_committed_json_is_what_the_code_builds():
    assert (DASHBOARD / "llmq.json").read_text() == _module().render(), \
        "regenerate it: .venv/bin/python deploy/grafana/dashboard.py"


async def test_every_query_names_only_series_a_live_metrics_serves(redis_url, prefix):
    dashboard = json.loads((DASHBOARD / "llmq.json").read_text())
    named = {name for expr in _exprs(dashboard) for name in re.findall(r"\bllmq_[a-z0-9_]+", expr)}
    assert len(named) >= 15  # every panel family the issue lists, and the tenants'
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.01), heartbeat_s=0.2,
                              tenant_header="x-tenant") as s:
        resp = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                                   headers={"x-tenant": "team-a"})
        assert resp.status_code == 200
        # One still running while it scrapes: the oldest unfinished job's age is a series then.
        running = (await s.client.post("/v1/jobs", json={"prompt": "long", "sampling": {"max_tokens": 1500}})).json()
        assert (await s.client.get("/v1/jobs/0000")).status_code == 404  # an error answer
        for _ in range(100):  # the worker pushes its series with each heartbeat
            text = (await s.client.get("/metrics")).text
            served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("llmq_")}
            if named <= served:
                break
            await asyncio.sleep(0.1)
        await s.client.delete(f"/v1/jobs/{running['id']}")
    assert named <= served, sorted(named - served)
