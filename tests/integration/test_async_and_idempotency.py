"""Every route that submits work honours ``Prefer: respond-async`` and ``Idempotency-Key``.

One table of submitting routes (every dialect but LMTP, whose WebSocket frames carry no headers):

- ``Prefer: respond-async`` answers 202 with the job's id and ``Location: /v1/jobs/<id>``; polling
  that finds the result in the route's own shape: equal to what the same request answers
  synchronously (a streaming route: what its non-streaming twin answers). A request that fans out
  into several jobs (a list of prompts, LMI's dynamic batch) gets one id, for a group.
- ``Idempotency-Key``: the same request sent twice with one key runs once (one set of job records)
  and both answers are the same, whether synchronous, streamed or fire-and-poll.

Real Redis, the real app on a real port, a scripted engine (tokens known in advance).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from shared.keys import Keys

PREFIX = "scripted-async"
CHAT = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
LMI = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "details": True}}
LMI_BATCH = {"inputs": ["abc", "xy"], "parameters": {"max_new_tokens": 3}}
TGI = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "details": True}}
TRITON = {"text_input": "abc", "max_tokens": 4}
HAPPY = {"prompt": "abc", "max_tokens": 4}


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    body: dict[str, Any]
    jobs: int = 1
    """How many jobs the request queues."""
    twin: tuple[str, dict[str, Any]] | None = None
    """For a streaming route: the non-streaming request whose answer its stored result equals."""
    unwrap: bool = False
    """The synchronous answer is a one-element array around the stored result (TGI's ``POST /``)."""


ROUTES = [
    Route("openai completions", "/v1/completions", {"prompt": "abc", "max_tokens": 4}),
    Route("openai completions, a list of prompts", "/v1/completions", {"prompt": ["abc", "xy"], "max_tokens": 3},
          jobs=2),
    Route("openai completions, streamed", "/v1/completions", {"prompt": "abc", "max_tokens": 4, "stream": True},
          twin=("/v1/completions", {"prompt": "abc", "max_tokens": 4})),
    Route("openai chat", "/v1/chat/completions", CHAT),
    Route("openai chat, streamed", "/v1/chat/completions", {**CHAT, "stream": True},
          twin=("/v1/chat/completions", CHAT)),
    Route("lmi rolling batch", "/invocations", LMI),
    Route("lmi rolling batch, streamed", "/invocations", {**LMI, "stream": True}, twin=("/invocations", LMI)),
    Route("lmi dynamic batch", "/invocations", LMI_BATCH, jobs=2),
    Route("lmi dynamic batch, streamed", "/invocations", {**LMI_BATCH, "stream": True}, jobs=2,
          twin=("/invocations", LMI_BATCH)),
    Route("lmi prompt (openai)", "/invocations", {"prompt": "abc", "max_tokens": 4}),
    Route("lmi chat", "/invocations", CHAT),
    Route("lmi predictions", "/predictions/tiny", LMI),
    Route("lmi predictions, dynamic batch", "/predictions/tiny", LMI_BATCH, jobs=2),
    Route("tgi generate", "/generate", TGI),
    Route("tgi generate_stream", "/generate_stream", TGI, twin=("/generate", TGI)),
    Route("tgi compat", "/", TGI, unwrap=True),
    Route("tgi compat, streamed", "/", {**TGI, "stream": True}, twin=("/", TGI), unwrap=True),
    Route("triton generate", "/v2/models/tiny/generate", TRITON),
    Route("triton generate, versioned", "/v2/models/tiny/versions/1/generate", TRITON),
    # Triton's vLLM backend streams the new text only (exclude_input_in_output defaults to true).
    Route("triton generate_stream", "/v2/models/tiny/generate_stream", {**TRITON, "stream": True},
          twin=("/v2/models/tiny/generate", {**TRITON, "exclude_input_in_output": True})),
    Route("triton generate_stream, versioned", "/v2/models/tiny/versions/1/generate_stream",
          {**TRITON, "stream": True}, twin=("/v2/models/tiny/generate", {**TRITON, "exclude_input_in_output": True})),
    Route("happy_vllm generate", "/v1/generate", HAPPY),
    Route("happy_vllm generate_stream", "/v1/generate_stream", HAPPY, twin=("/v1/generate", HAPPY)),
    Route("llmq jobs", "/v1/jobs", {"prompt": "abc", "sampling": {"max_tokens": 4}}),
]
IDS = [r.name for r in ROUTES]


pytestmark = pytest.mark.stack(prefix=PREFIX)  # one stack for the module: tests/integration/conftest.py


def _stable(body: Any) -> Any:
    """An answer without what differs between two runs of one request: ids and timestamps."""
    if isinstance(body, list):
        return [_stable(x) for x in body]
    if isinstance(body, dict):
        return {k: _stable(v) for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}
    return body


def _per_input(jsonlines: bytes) -> list[str]:
    """LMI's dynamic-batch stream folded into each input's text."""
    texts: list[str] = []
    for line in jsonlines.splitlines():
        outputs = json.loads(line)["outputs"]
        texts = texts or [""] * len(outputs)
        texts = [t + o for t, o in zip(texts, outputs, strict=True)]
    return texts


async def _job_count(stack) -> int:
    return len([k async for k in stack.redis.scan_iter(match=Keys(PREFIX).job("tiny", "*"), count=1000)])


async def _poll(client: httpx.AsyncClient, location: str) -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:
            view = (await client.get(location)).json()
            if view["status"] in ("done", "failed", "cancelled"):
                return view
            await asyncio.sleep(0.05)


async def _answer(client: httpx.AsyncClient, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    """The whole answer (a stream read to its end)."""
    resp = await client.post(path, json=body, headers=headers)
    assert resp.status_code == 200, (path, resp.status_code, resp.text)
    return resp


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
async def test_respond_async_answers_202_and_the_poll_has_the_routes_own_answer(stack, route: Route):
    client = stack.client
    before = await _job_count(stack)
    resp = await client.post(route.path, json=route.body, headers={"Prefer": "respond-async"})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    assert resp.headers["location"] == f"/v1/jobs/{job_id}" == resp.json()["url"]
    assert job_id.startswith("grp-") == (route.jobs > 1)
    view = await _poll(client, resp.headers["location"])
    assert view["status"] == "done", view
    assert await _job_count(stack) == before + route.jobs
    path, body = route.twin or (route.path, route.body)
    if path == "/v1/jobs":
        return  # its only answer is the poll: a JobResult, checked in tests/integration/test_stack_scripted.py
    sync = (await _answer(client, path, body)).json()
    if route.unwrap:
        (sync,) = sync
    assert _stable(view["result"]) == _stable(sync)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
async def test_a_repeated_idempotency_key_runs_the_request_once(stack, route: Route):
    client = stack.client
    key = {"Idempotency-Key": uuid.uuid4().hex}
    before = await _job_count(stack)
    if route.path == "/v1/jobs":
        first, again = [(await client.post(route.path, json=route.body, headers=key)).json() for _ in range(2)]
        assert first["id"] == again["id"]
    elif route.jobs > 1 and route.body.get("stream"):
        # Several jobs' events interleave as they arrive, so compare what each input received.
        first, again = [_per_input((await _answer(client, route.path, route.body, **key)).content)
                        for _ in range(2)]
        assert first == again and all(first), first
    else:
        first, again = [(await _answer(client, route.path, route.body, **key)).content for _ in range(2)]
        assert first == again, "the same job's answer, byte for byte"
    assert await _job_count(stack) == before + route.jobs
    if route.path == "/v1/jobs":
        return
    queued = await client.post(route.path, json=route.body, headers={**key, "Prefer": "respond-async"})
    assert queued.status_code == 202
    if route.jobs == 1:
        # The same job: its result is the answer both synchronous requests got.
        view = await _poll(client, queued.headers["location"])
        assert view["status"] == "done"
    assert await _job_count(stack) == before + route.jobs, "the fire-and-poll repeat found the same jobs"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}),
])
async def test_a_repeat_a_second_later_answers_with_the_first_jobs_creation_time(stack, path, body):
    """The repeat's answer is the earlier job's: its ``created`` too, not the repeat's own clock
    (seen in CI when the two requests fell on either side of a second)."""
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = (await _answer(stack.client, path, body, **key)).content
    await asyncio.sleep(1.1)
    again = (await _answer(stack.client, path, body, **key)).content
    assert again == first


async def test_a_group_is_cancelled_as_one_job_and_its_events_point_to_its_jobs(stack):
    client = stack.client
    body = {"prompt": ["abc", "xy"], "max_tokens": 2000}  # long enough to cancel mid-way (scripted: 1 ms/token)
    resp = await client.post("/v1/completions", json=body, headers={"Prefer": "respond-async"})
    location = resp.headers["location"]
    view = (await client.delete(location)).json()
    assert view["object"] == "job.group" and len(view["jobs"]) == 2
    view = await _poll(client, location)
    assert view["status"] == "cancelled" and view["result"] is None
    for job_id in view["jobs"]:
        assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "cancelled"
    events = await client.get(f"{location}/events")
    assert events.status_code == 400 and view["jobs"][0] in events.text
