"""The console in a real browser (Debian's Chromium, driven by Playwright) against real processes:
one API, housekeeping and vLLM workers on the tiny model, started and SIGKILLed by the tests.

Keys on: tenants A and B, and an operator. The module's deployment starts with no worker, so the
first test sees a job queued while nothing is warm; later tests add a second worker, kill the one
streaming a job, and make a real dead letter (a worker killed mid-job, its successor allowed one
delivery). Each test leaves a screenshot of its page in CONSOLE_SCREENSHOTS when that is set
(docs/console.md's pictures are these: ``CONSOLE_SCREENSHOTS=docs/console pytest
tests/e2e/test_console.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from playwright.async_api import expect
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from shared.tenants import key_hash
from tests.conftest import free_port
from tests.support.browser import browser
from tests.support.event_log import logged_events
from tests.support.real_processes import ready_pids, spawn, stop_all, tail
from tests.support.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

A, B, OP = "console-tenant-a", "console-tenant-b", "console-operator"
LEASE_S = 3
LONG = {"prompt": "Once upon a time", "sampling": {"max_tokens": 600, "ignore_eos": True, "temperature": 0}}
SHOTS = Path(os.environ["CONSOLE_SCREENSHOTS"]) if os.environ.get("CONSOLE_SCREENSHOTS") else None


@dataclass
class Deployment:
    url: str
    redis: Redis
    keys: Keys
    model: str
    env: dict[str, str]
    logs: Path
    procs: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)
    spawned: int = 0

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{tail(log)}" for _, log in self.procs)

    def start_worker(self, **extra: str) -> subprocess.Popen:
        log = self.logs / f"worker{self.spawned}.log"
        self.spawned += 1
        proc = spawn(["-m", "workers"], {**self.env, **extra}, log)
        self.procs.append((proc, log))
        return proc

    def wait_ready(self, *workers: subprocess.Popen) -> None:
        def ready() -> bool:
            assert all(p.poll() is None for p in workers), self.tails()
            return {p.pid for p in workers} <= ready_pids(self.redis, self.keys)
        eventually_sync(ready, timeout_s=400, interval_s=0.5, what=lambda: f"workers to warm up\n{self.tails()}")

    def record(self, job_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.job(self.model, job_id))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"log"}

    def kill_worker_of(self, job_id: str, after_tokens: int) -> str:
        """SIGKILL the worker running ``job_id`` once its log holds ``after_tokens`` tokens."""
        def running() -> bool:
            events = logged_events(self.redis, self.keys, self.model, job_id)
            tokens = sum(len(d.get("token_ids") or []) for _, e in events for d in e.get("deltas") or [])
            return self.record(job_id).get("status") == "running" and tokens >= after_tokens
        eventually_sync(running, timeout_s=300, interval_s=0.005, what=lambda: f"{job_id} to run\n{self.tails()}")
        worker = self.record(job_id)["worker"]
        os.kill(int(self.redis.hget(self.keys.worker(worker), "pid")), signal.SIGKILL)
        return worker


@pytest.fixture(scope="module")
def deployment(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("console-logs")
    prefix = f"console-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_LEASE_S": str(LEASE_S), "LLMQ_API_KEYS": f"{A},{B}", "LLMQ_OPERATOR_KEYS": OP,
           "LLMQ_PORT": str(port)}
    redis = Redis.from_url(redis_url)
    d = Deployment(url=f"http://127.0.0.1:{port}", redis=redis, keys=Keys(prefix),
                   model=load_settings({}).model_name, env=env, logs=logs)
    for name, args in (("api", ["-m", "api"]), ("housekeeping", ["-m", "workers.housekeeping"])):
        d.procs.append((spawn(args, env, logs / f"{name}.log"), logs / f"{name}.log"))
    try:
        eventually_sync(lambda: _ok(f"{d.url}/readyz"), timeout_s=60, interval_s=0.2,
                        what=lambda: f"the API to start\n{d.tails()}")
        yield d
    finally:
        stop_all(d.procs)
        redis.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def submit(d: Deployment, key: str, body: dict | None = None) -> str:
    resp = httpx.post(f"{d.url}/v1/jobs", json=body or {"prompt": "Hello", "sampling": {"max_tokens": 8}},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


@pytest.fixture
async def console(deployment: Deployment) -> AsyncIterator:
    """``open(key, page)``: a fresh browser context on the console, the key typed into its form."""
    async with browser() as chromium:
        contexts = []

        async def open_page(key: str, where: str = "#/overview", dark: bool = False):
            context = await chromium.new_context(viewport={"width": 1280, "height": 860},
                                                 color_scheme="dark" if dark else "light")
            contexts.append(context)
            page = await context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.errors = errors
            await page.goto(f"{deployment.url}/console{where}")
            await page.fill("#key", key)
            await page.press("#key", "Enter")  # the form submits from the keyboard
            # Locator waits, not wait_for_function: the console's CSP forbids the eval that one polls with.
            await expect(page.get_by_test_id("role")).not_to_have_text(re.compile(r"^\s*(…|unknown)\s*$"))
            return page

        yield open_page
        for context in contexts:
            await context.close()


async def shot(page, name: str) -> None:
    if SHOTS is not None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        await page.evaluate("document.activeElement?.blur()")  # no focus ring left on the key field
        await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=False)


def row(page, job_id: str):
    return page.locator(f"[data-testid=job-row][data-job='{job_id}']")


async def test_a_job_queued_while_no_worker_is_warm_completes_when_one_starts(deployment: Deployment, console):
    page = await console(OP, "#/jobs")
    assert (await page.text_content("[data-testid=role]")).strip() == "operator"
    job_id = submit(deployment, A)
    await row(page, job_id).wait_for(timeout=15_000)
    assert "queued" in await row(page, job_id).inner_text()
    worker = deployment.start_worker()
    await asyncio.to_thread(deployment.wait_ready, worker)
    await expect(row(page, job_id)).to_contain_text("done", timeout=60_000)
    cells = await row(page, job_id).inner_text()
    assert key_hash(A) in cells and "jobs" in cells
    await shot(page, "jobs")
    assert page.errors == []


async def test_the_playground_streams_a_chat_answer(deployment: Deployment, console):
    page = await console(A, "#/playground")
    await page.select_option("[data-testid=pg-dialect]", "openai_chat")
    await page.fill("[data-testid=pg-prompt]", "Tell me a story.")
    await page.fill("[data-testid=pg-max-tokens]", "40")
    assert await page.is_checked("[data-testid=pg-stream]")
    await page.click("[data-testid=pg-send]")
    await page.locator("[data-testid=pg-done]").wait_for(state="visible", timeout=60_000)
    sent = await page.text_content("[data-testid=pg-request]")
    got = await page.text_content("[data-testid=pg-response]")
    answer = await page.text_content("[data-testid=pg-answer]")
    # The exact bytes: the request line and its JSON body, the key masked; an SSE stream of chunks.
    assert sent.startswith("POST /v1/chat/completions") and A not in sent
    body = json.loads(sent.split("\n\n", 1)[1])
    assert body["stream"] is True and body["messages"][0]["content"] == "Tell me a story."
    assert got.startswith("HTTP/1.1 200") and "text/event-stream" in got
    chunks = [json.loads(line.removeprefix("data: ")) for line in got.splitlines()
              if line.startswith("data: {")]
    assert len(chunks) >= 3 and got.rstrip().endswith("data: [DONE]")
    assert answer == "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert answer.strip()
    await shot(page, "playground")
    # Anthropic Messages with a tool, whole: the tool in its own shape, and the message back.
    await page.select_option("[data-testid=pg-dialect]", "anthropic_messages")
    await page.uncheck("[data-testid=pg-stream]")
    await page.check("[data-testid=pg-tools]")
    await page.click("[data-testid=pg-send]")
    await expect(page.get_by_test_id("pg-response")).to_contain_text('"type":"message"', timeout=60_000)
    sent = await page.text_content("[data-testid=pg-request]")
    body = json.loads(sent.split("\n\n", 1)[1])
    assert sent.startswith("POST /v1/messages") and body["stream"] is False
    assert body["tools"] == [{"name": "get_weather", "description": "Get the current weather in a city",
                              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}}]
    got = await page.text_content("[data-testid=pg-response]")
    message = json.loads(got.split("\n\n", 1)[1])
    assert got.startswith("HTTP/1.1 200") and message["role"] == "assistant"
    assert message["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert page.errors == []


async def test_a_tenant_key_sees_only_its_own_jobs(deployment: Deployment, console):
    mine, theirs = submit(deployment, A), submit(deployment, B)
    page = await console(A, "#/jobs")
    await row(page, mine).wait_for(timeout=15_000)
    shown = [await r.get_attribute("data-job") for r in await page.locator("[data-testid=job-row]").all()]
    assert mine in shown and theirs not in shown
    # Its tenants page is its own row only; another key's job is not found at all.
    await page.goto(f"{deployment.url}/console#/tenants")
    await page.wait_for_selector(f"text={key_hash(A)}")
    assert key_hash(B) not in await page.inner_text("main")
    await shot(page, "tenants")
    await page.goto(f"{deployment.url}/console#/jobs/{theirs}")
    await page.locator("[data-testid=banner]").wait_for(state="visible", timeout=15_000)
    assert "not found" in (await page.inner_text("[data-testid=banner]")).lower()
    assert "Hello" not in await page.inner_text("main")


async def test_a_sigkilled_workers_job_shows_a_second_attempt_and_an_unbroken_stream(deployment: Deployment,
                                                                                      console):
    # Blocking waits run in a thread: the browser's connection lives on this event loop.
    await asyncio.to_thread(deployment.wait_ready, deployment.start_worker(),
                            *(p for p, log in deployment.procs if log.name.startswith("worker") and p.poll() is None))
    job_id = submit(deployment, A, LONG)
    # The kill watches the job's log while the page opens: the tiny model writes 600 tokens in
    # about a second, faster than a browser starts. The page replays what was logged, then
    # follows the successor live.
    kill = asyncio.create_task(asyncio.to_thread(deployment.kill_worker_of, job_id, 20))
    page = await console(OP, f"#/jobs/{job_id}")
    killed = await kill
    await expect(page.get_by_test_id("job-status")).to_have_text("done", timeout=180_000)
    await expect(page.get_by_test_id("job-run")).to_have_count(2, timeout=10_000)
    runs = [await r.inner_text() for r in await page.locator("[data-testid=job-run]").all()]
    assert killed in runs[0] and killed not in runs[1], runs
    # The page's events are the log's, each once, in order, across the takeover.
    seqs = [int(await e.get_attribute("data-seq")) for e in await page.locator("[data-testid=job-event]").all()]
    logged = logged_events(deployment.redis, deployment.keys, deployment.model, job_id)
    assert seqs == list(range(1, len(logged) + 1)), seqs
    result = json.loads(deployment.record(job_id)["result"])
    assert await page.text_content("[data-testid=job-output]") == result["choices"][0]["text"]
    assert (await page.text_content("[data-testid=job-stream]")).startswith("Stream ended (done)")
    await shot(page, "job")
    assert page.errors == []


async def test_requeue_from_the_dead_letters_works_for_an_operator_and_is_refused_for_a_tenant(
        deployment: Deployment, console):
    # A real dead letter: its worker killed mid-job, and the successor allowed one delivery only.
    job_id = submit(deployment, A, LONG)
    await asyncio.to_thread(deployment.kill_worker_of, job_id, 5)
    strict = deployment.start_worker(LLMQ_MAX_DELIVERIES="1")
    await asyncio.to_thread(deployment.wait_ready, strict)
    await asyncio.to_thread(eventually_sync, lambda: deployment.record(job_id).get("status") == "failed",
                            timeout_s=60, what=lambda: f"{job_id} to be dead-lettered\n{deployment.tails()}")
    assert json.loads(deployment.record(job_id)["error"])["code"] == "dead_letter"

    tenant = await console(A, "#/dead")
    dead_row = tenant.locator(f"[data-testid=dead-row][data-job='{job_id}']")
    await dead_row.wait_for(timeout=15_000)
    await dead_row.locator("[data-testid=requeue]").click()
    message = tenant.locator("[data-testid=dead-message]")
    await message.filter(has_text="operator").wait_for(timeout=15_000)
    assert deployment.redis.xlen(deployment.keys.dead(deployment.model)) == 1

    operator = await console(OP, "#/dead")
    dead_row = operator.locator(f"[data-testid=dead-row][data-job='{job_id}']")
    await dead_row.wait_for(timeout=15_000)
    assert "dead_letter" in await dead_row.inner_text()
    await shot(operator, "dead-letters")
    await dead_row.locator("[data-testid=requeue]").focus()
    await operator.keyboard.press("Enter")  # the buttons work from the keyboard
    await operator.locator("[data-testid=dead-message]").filter(has_text="requeued as").wait_for(timeout=15_000)
    new_id = (await operator.text_content("[data-testid=dead-message]")).split("requeued as", 1)[1].split()[0]
    assert new_id != job_id and len(new_id) == 32
    await asyncio.to_thread(eventually_sync, lambda: deployment.record(new_id).get("status") == "done",
                            timeout_s=120, what=lambda: f"the requeued job {new_id} to finish\n{deployment.tails()}")
    # Still tenant A's: its key owns it (an ended record's tenant is its owner's, tenants.lua).
    assert deployment.record(new_id)["owner"] == key_hash(A) and "tenant" not in deployment.record(new_id)
    assert deployment.redis.xlen(deployment.keys.dead(deployment.model)) == 0


async def test_the_overview_shows_workers_slots_queues_and_their_history(deployment: Deployment, console):
    page = await console(OP, "#/overview")
    await page.wait_for_selector("svg", timeout=30_000)
    text = await page.inner_text("main")
    assert deployment.model in text and "ready" in text
    assert "tp=1" in text  # each worker's engine layout: one device each here
    await shot(page, "overview")
    dark = await console(OP, "#/overview", dark=True)
    await dark.wait_for_selector("svg", timeout=30_000)
    assert await dark.evaluate("getComputedStyle(document.body).backgroundColor") != \
        await page.evaluate("getComputedStyle(document.body).backgroundColor")
    await shot(dark, "overview-dark")
