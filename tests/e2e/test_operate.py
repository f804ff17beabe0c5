"""Operating the real stack (vLLM workers): /metrics and the status CLI see the workers' jobs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def _totals(url: str, model: str) -> dict[str, float]:
    """Each worker family summed over the workers (a sum, so the figures of workers started or
    stopped by other tests only add)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            key = s.name + (f"/{s.labels['outcome']}" if "outcome" in s.labels else "")
            if "le" in s.labels or s.name in ("llmq_queue_lag", "llmq_queue_pending", "llmq_queue_depth"):
                continue
            out[key] = out.get(key, 0) + s.value
    return out


def test_metrics_count_a_real_generation(stack):
    before = _totals(stack.url, stack.model)
    body = {"model": stack.model, "prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0}
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 30
    while True:  # workers push their figures with each heartbeat (1 s here)
        after = _totals(stack.url, stack.model)
        if after.get("llmq_worker_jobs_ended_total/done", 0) > before.get("llmq_worker_jobs_ended_total/done", 0):
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.5)
    for name, least in (("llmq_worker_tokens_total", 8), ("llmq_worker_jobs_started_total", 1),
                        ("llmq_ttft_seconds_count", 1), ("llmq_e2e_seconds_count", 1),
                        ("llmq_queue_wait_seconds_count", 1)):
        assert after.get(name, 0) - before.get(name, 0) >= least, (name, before, after)
    assert after["llmq_workers_ready"] >= 1


def test_status_cli_lists_the_ready_workers(stack):
    out = subprocess.run([sys.executable, "-m", "shared.status", "--url", stack.redis_url, "--prefix", stack.prefix,
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    status = json.loads(out.stdout)
    [model] = [m for m in status["models"] if m["name"] == stack.model]
    ready = [w for w in status["workers"] if w["model"] == stack.model and w["status"] == "ready"]
    assert model["ready_workers"] == len(ready) >= 1
    assert all(w["slots"] == 32 and w["last_heartbeat_age_s"] < 10 for w in ready)
