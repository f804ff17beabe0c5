"""A queue that never refuses work for a known model: requests sent while no worker is warm wait
in the stream, and complete once a worker has loaded (real processes, real vLLM on the tiny model).

Web + Redis start with no worker. A streamed OpenAI completion (the ``openai`` client, and the
same over a raw socket to see its keep-alive comments), a synchronous LMI request, a
fire-and-poll job and an LMQL query are sent; a worker starts 15 s later. Every one must complete
with all its tokens, and the raw stream must have received keep-alives while it waited.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import lmql
import openai
import pytest

from shared.config import load_settings
from tests.conftest import free_port
from tests.support.real_processes import spawn, stop_all, tail, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


async def _ready(client: httpx.AsyncClient) -> bool:
    """The web process serves and reaches Redis (workers or none)."""
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False

TINY_DIR = load_settings({}).model_path
WORKER_AFTER_S = 15
KEEPALIVE_S = 2
TOKENS = 24


@pytest.fixture
def cold(redis_url: str, tmp_path: Path):
    prefix = f"cold-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_MAX_MODEL_LEN": "1024", "LLMQ_HEARTBEAT_S": "1",
           "LLMQ_SSE_KEEPALIVE_S": str(KEEPALIVE_S)}
    port = free_port()
    procs: list[tuple[subprocess.Popen, Path]] = []
    log = tmp_path / "api.log"
    procs.append((spawn(["-m", "api"], {**env, "LLMQ_PORT": str(port)}, log), log))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # the web process is up and reaches Redis; no worker anywhere on this prefix
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.2)

    def start_worker() -> None:
        wlog = tmp_path / "worker.log"
        procs.append((spawn(["-m", "workers"], env, wlog), wlog))

    def impatient_api() -> str:
        """A second web process on the same queue whose clients wait for a worker only 2 s."""
        port = free_port()
        log = tmp_path / "api-impatient.log"
        procs.append((spawn(["-m", "api"], {**env, "LLMQ_PORT": str(port), "LLMQ_COLD_WAIT_S": "2"}, log), log))
        return f"http://127.0.0.1:{port}"

    try:
        yield url, start_worker, procs, impatient_api
    finally:
        stop_all(procs)


async def test_requests_sent_with_no_worker_complete_once_one_starts(cold):
    url, start_worker, procs, impatient_api = cold
    model = load_settings({}).model_name
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        ping = await http.get("/ping")
        assert ping.status_code == 503 and ping.json()["ready_workers"] == 0  # nothing warm: the probe says so
        assert (await http.get("/livez")).status_code == 200

        async def raw_stream() -> tuple[list[bytes], int]:
            """SSE lines, and how many keep-alive comments came before the first token."""
            body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            lines: list[bytes] = []
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line:
                        lines.append(line.encode())
            first = next(i for i, line in enumerate(lines) if line.startswith(b"data: {"))
            return lines, sum(line == b": keep-alive" for line in lines[:first])

        async def sdk_stream() -> str:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
            text, usage = "", None
            stream = await client.completions.create(
                model=model, prompt="The quick brown fox", max_tokens=TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == TOKENS
            return text

        async def lmi_sync() -> dict:
            body = {"inputs": "In the beginning", "parameters": {"max_new_tokens": TOKENS, "do_sample": False,
                                                                  "ignore_eos_token": True, "details": True}}
            resp = await http.post("/invocations", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        async def fire_and_poll() -> dict:
            resp = await http.post("/v1/jobs", json={"prompt": "Hello", "sampling": {
                "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}})
            assert resp.status_code == 202, resp.text
            location = resp.headers["location"]
            while (view := (await http.get(location)).json())["status"] not in ("done", "failed", "cancelled"):
                await asyncio.sleep(0.5)
            return view

        async def lmql_query() -> str:
            endpoint = url.removeprefix("http://")
            result = await lmql.run('"Is the sky blue? Answer: [ANSWER]" where ANSWER in ["yes", "no"]',
                                    model=lmql.model(model, endpoint=endpoint, tokenizer=TINY_DIR))
            return result.variables["ANSWER"]

        async def out_of_patience(impatient: str) -> list[tuple[int, dict]]:
            """While no worker is up: a client whose cold wait (2 s) runs out gets its dialect's 504."""
            async with httpx.AsyncClient(base_url=impatient, timeout=60) as other:
                deadline = time.monotonic() + 30
                while not await _ready(other):
                    assert time.monotonic() < deadline, "the second web process did not start"
                    await asyncio.sleep(0.2)
                answers = [await other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}),
                           await other.post("/invocations", json={"inputs": "x"})]
                return [(r.status_code, r.json()) for r in answers]

        sent_at = time.monotonic()
        work = asyncio.gather(raw_stream(), sdk_stream(), lmi_sync(), fire_and_poll(), lmql_query())
        timed_out = await out_of_patience(impatient_api())
        await asyncio.sleep(max(0.0, WORKER_AFTER_S - (time.monotonic() - sent_at)))
        start_worker()
        (lines, keepalives), sdk_text, lmi, job, answer = await work
        waited_s = time.monotonic() - sent_at

    wait_ready(url, procs, 1)
    message = "no worker became ready to serve this request within 2 s (LLMQ_COLD_WAIT_S)"
    assert timed_out == [
        (504, {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 504}}),
        (504, {"code": 504, "type": "deadline_exceeded", "message": message}),
    ]
    # A chunk per engine step, and one with the usage last (a step's text may be empty: held back
    # inside a UTF-8 character), so the tokens are counted from the usage.
    usage = json.loads(lines[-2].removeprefix(b"data: "))["usage"]
    assert usage["completion_tokens"] == TOKENS and lines[-1] == b"data: [DONE]", lines[-3:]
    # Every KEEPALIVE_S while it waited: 15 s before the worker was even started, then its load.
    assert keepalives >= WORKER_AFTER_S // KEEPALIVE_S - 1, keepalives
    assert sdk_text
    assert lmi["details"]["generated_tokens"] == TOKENS and lmi["details"]["finish_reason"] == "length"
    assert job["status"] == "done" and job["result"]["usage"]["completion_tokens"] == TOKENS
    assert answer in ("yes", "no")
    print(f"all five completed {waited_s:.1f} s after they were sent (worker started after {WORKER_AFTER_S} s); "
          f"{keepalives} keep-alives before the first token")
