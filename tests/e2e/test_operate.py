"""Operating the real stack (vLLM workers): /metrics and the status CLI see the workers' jobs; batch
files and webhooks run through the housekeeping process."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from shared.webhooks import ID_HEADER, verify
from tests.conftest import REPO
from tests.support.background import housekeeping

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


class _Hooks(http.server.BaseHTTPRequestHandler):
    hits: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["content-length"]))
        _Hooks.hits.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_batch_file_and_a_webhook_run_on_real_vllm(stack, tmp_path):
    """The OpenAI SDK's files and batches calls, run by the real housekeeping process on the real
    workers: the batch's outputs equal direct greedy calls. A /v1/jobs webhook is delivered signed."""
    secret = "e2e-secret"
    allow = "127.0.0.1/32"  # the receiver is on loopback, which webhooks may not reach by default
    url = stack.api(LLMQ_WEBHOOK_SECRET=secret, LLMQ_WEBHOOK_ALLOW=allow)
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    prompts = ["Once upon a time", "The capital of", "In the beginning"]
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": stack.model, "messages": [{"role": "user", "content": p}], "max_tokens": 8,
                       "temperature": 0}} for i, p in enumerate(prompts)]
    try:
        with housekeeping(stack.redis_url, stack.prefix, tmp_path, webhook_secret=secret, webhook_allow=allow,
                          served_model_name=stack.model):
            upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                         purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            job = httpx.post(f"{url}/v1/jobs", json={"prompt": "Hello", "sampling": {"max_tokens": 6},
                                                     "webhook": f"http://127.0.0.1:{receiver.server_port}/hook"},
                             timeout=30).json()["id"]
            deadline = time.monotonic() + 240
            while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
                assert time.monotonic() < deadline, batch
                time.sleep(0.5)
            while not _Hooks.hits:
                assert time.monotonic() < deadline, "no webhook delivery"
                time.sleep(0.2)
    finally:
        receiver.shutdown()
        receiver.server_close()

    assert batch.status == "completed" and batch.request_counts.completed == len(prompts)
    output = {json.loads(x)["custom_id"]: json.loads(x) for x in client.files.content(batch.output_file_id).text
              .splitlines()}
    for i, prompt in enumerate(prompts):
        direct = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=0)
        body = output[f"p{i}"]["response"]["body"]
        assert output[f"p{i}"]["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens == 8

    [(headers, body)] = _Hooks.hits
    assert headers[ID_HEADER.lower()] == job and verify(secret, body, headers)
    assert json.loads(body) == httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json()
    assert json.loads(body)["result"]["usage"]["completion_tokens"] == 6
