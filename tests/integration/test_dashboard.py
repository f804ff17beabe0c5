"""The Grafana dashboard in deploy/grafana: its JSON is what the code in dashboard.py builds, every
query names only series a live /metrics serves (the real app, real Redis, a worker with a scripted
engine, after a job of a tenant and an error answer), and a deployment that has served nothing yet
already declares every family and serves a series for every panel but the tenants'."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

from prometheus_client.parser import text_string_to_metric_families

from shared.keys import LEVELS, Keys
from shared.metrics import CATALOGUE
from tests.conftest import REPO
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually

DASHBOARD = REPO / "deploy" / "grafana"


def _module():
    spec = importlib.util.spec_from_file_location("llmq_dashboard", DASHBOARD / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _named(dashboard: dict) -> set[str]:
    """The series the dashboard's queries name (a histogram's by its ``_bucket`` series)."""
    return {name for expr in _exprs(dashboard) for name in re.findall(r"\bllmq_[a-z0-9_]+", expr)}


def test_the_committed_json_is_what_the_code_builds():
    assert (DASHBOARD / "llmq.json").read_text() == _module().render(), \
        "regenerate it: .venv/bin/python deploy/grafana/dashboard.py"


async def test_every_query_names_only_series_a_live_metrics_serves(redis_url, prefix):
    dashboard = json.loads((DASHBOARD / "llmq.json").read_text())
    named = _named(dashboard)
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


async def test_a_fresh_metrics_declares_every_family_and_has_a_series_for_each_panel(redis_url, prefix):
    """Before any request: no error answered yet, every level empty. Every family is declared
    (HELP and TYPE), and each series a panel queries has a sample (zero, or an empty level's age
    of 0), so a new deployment's panels show 0, not "No data". The tenants' series are the one
    exception: their ``tenant`` label has no value before some tenant queues a job."""
    named = _named(json.loads((DASHBOARD / "llmq.json").read_text()))
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.01), heartbeat_s=0.2) as s:
        # The worker's first heartbeat after it became ready carries its series; the API's own are
        # as of the scrape. Nothing else may happen first: no request, no error answer.
        await eventually(lambda: s.redis.hget(Keys(prefix).worker(s.worker.worker_id), "metrics"),
                         what="the worker's first pushed series")
        text = (await s.client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    served = {sample.name for f in families.values() for sample in f.samples}
    declared = {(name, f"# TYPE {name} {metric.kind}" in text) for name, metric in CATALOGUE.items()}
    assert {name for name, typed in declared if not typed} == set()
    assert named - served == {n for n in named if n.startswith("llmq_tenant_")}
    levels = {s.labels["level"]: s.value for s in families["llmq_queue_oldest_age_seconds"].samples}
    assert levels == {str(level): 0 for level in range(LEVELS)}
    errors = families["llmq_api_errors"].samples
    assert errors and all(e.value == 0 for e in errors)
