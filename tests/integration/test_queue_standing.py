"""A waiting job's place in the queue (issue 44, part 4): ``GET /v1/jobs/{id}``'s ``queue_position``
and ``eta_s``, the SSE comment ``: queue position=N eta_s=X`` a waiting stream gets before its
first token, the real SDK clients reading such a stream, and the position falling as the queue drains.

The real app on a real port and real Redis; jobs are queued with no worker, and a scripted worker
of one slot starts later, so every job waits and those queued first run first. The position is
``JobStore.position``'s; until the queue measures a model's speed the ETA is unknown (and a waiting
stream's keep-alives plain), so the tests that need one wrap the position with an ETA of one second
per job ahead (:func:`with_eta`).
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import httpx
import httpx2
import openai
import pytest
from huggingface_hub import InferenceClient

from shared.config import Settings
from shared.framing import comment
from shared.keys import Keys
from shared.queue import Consumer, JobStore
from shared.redis import connect
from shared.slo import Capacity, Standing
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_settings, serve_api
from tests.support.waiting import eventually
from workers.runner import Worker

RENDERERS = importlib.import_module("api.dialects.stream")  # (the package's ``stream`` is a function)
STANDING = re.compile(rb"^: queue position=(\d+) eta_s=(\d+\.\d)$")


@pytest.fixture
async def api(redis_url: str, prefix: str) -> AsyncIterator[tuple[httpx.AsyncClient, Settings]]:
    """An API with no worker yet: keep-alives every 0.5 s, one engine slot per worker."""
    settings = scripted_settings(redis_url, prefix, max_num_seqs=1, sse_keepalive_s=0.5)
    async with serve_api(settings) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield client, settings


@pytest.fixture
def with_eta(monkeypatch: pytest.MonkeyPatch) -> list[Standing]:
    """``JobStore.position`` as it is, with an ETA of 1 s per job ahead when it has none; returns
    every standing it gave (what the relay read for its keep-alives)."""
    given: list[Standing] = []
    position = JobStore.position

    async def standing(self: JobStore, model: str, job_id: str, capacity: Capacity) -> Standing | None:
        found = await position(self, model, job_id, capacity)
        if found is not None and found.eta_s is None:
            found = Standing(position=found.position, eta_s=float(found.position))
        if found is not None:
            given.append(found)
        return found

    monkeypatch.setattr(JobStore, "position", standing)
    return given


@asynccontextmanager
async def worker(settings: Settings, delay_s: float = 0.001) -> AsyncIterator[Worker]:
    """A scripted worker for the API's model, from now until the block ends."""
    redis = connect(settings.redis_url)
    w = Worker(settings, Consumer(redis, Keys(settings.prefix)), ScriptedEngine(delay_s=delay_s),
               worker_id=f"w-{settings.prefix}")
    task = asyncio.create_task(w.run())
    try:
        yield w
    finally:
        w.stop()
        await asyncio.wait_for(task, 10)
        await redis.aclose()


async def queue_jobs(client: httpx.AsyncClient, n: int, max_tokens: int = 2) -> list[str]:
    ids = []
    for _ in range(n):
        resp = await client.post("/v1/jobs", json={"prompt": "ab", "sampling": {"max_tokens": max_tokens}})
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["id"])
    return ids


class Tee(httpx2.AsyncHTTPTransport):
    """The bytes a response carried, as the SDK's HTTP client received them (the SDK drops comments).
    (The openai and anthropic SDKs' HTTP client is ``httpx2``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.seen = bytearray()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        resp = await super().handle_async_request(request)
        inner, seen = resp.stream, self.seen

        class Recorded(httpx2.AsyncByteStream):
            async def __aiter__(self):
                async for chunk in inner:  # type: ignore[union-attr]
                    seen.extend(chunk)
                    yield chunk

            async def aclose(self) -> None:
                await inner.aclose()  # type: ignore[union-attr]

        resp.stream = Recorded()
        return resp


# Frames a stream opens with, before any event of its job (OpenAI Responses').
OPENING = (b'"type":"response.created"', b'"type":"response.in_progress"')


def comments_before_data(raw: bytes) -> tuple[list[bytes], list[bytes]]:
    """The comment lines before the stream's first ``data:`` line of its job's events, and those after it."""
    lines = [line for line in raw.split(b"\n") if line]
    first = next(i for i, line in enumerate(lines)
                 if line.startswith(b"data:") and not any(o in line for o in OPENING))
    return [x for x in lines[:first] if x.startswith(b":")], [x for x in lines[first:] if x.startswith(b":")]


# --- GET /v1/jobs/{id} ----------------------------------------------------------------------------


async def test_a_queued_job_shows_its_position_and_an_ended_one_none(api):
    client, settings = api
    ids = await queue_jobs(client, 3)
    views = [(await client.get(f"/v1/jobs/{job_id}")).json() for job_id in ids]
    assert [v["status"] for v in views] == ["queued"] * 3
    positions = [v["queue_position"] for v in views]
    assert all(isinstance(p, int) for p in positions) and positions == sorted(positions)
    assert positions[-1] >= 2  # two jobs of its model were queued before it
    assert all(v["eta_s"] is None or isinstance(v["eta_s"], float) for v in views)
    async with worker(settings):
        async def done() -> bool:
            return (await client.get(f"/v1/jobs/{ids[-1]}")).json()["status"] == "done"
        await eventually(done, timeout_s=30, what="the jobs to run")
    ended = (await client.get(f"/v1/jobs/{ids[-1]}")).json()
    assert ended["queue_position"] is None and ended["eta_s"] is None


async def test_the_position_falls_as_the_jobs_ahead_are_taken(api):
    """Five jobs, one slot: the last one's position, polled, steps down as each job ahead starts."""
    client, settings = api
    ids = await queue_jobs(client, 5, max_tokens=12)
    seen: list[int] = []

    async def poll_until_started() -> None:
        while True:
            view = (await client.get(f"/v1/jobs/{ids[-1]}")).json()
            if view["status"] != "queued":
                assert view["queue_position"] is None
                return
            # (None: read just as the job was taken, after its record said queued)
            if view["queue_position"] is not None and (not seen or seen[-1] != view["queue_position"]):
                seen.append(view["queue_position"])
            await asyncio.sleep(0.02)

    async with worker(settings, delay_s=0.03):  # 12 tokens: about 0.4 s a job
        await asyncio.wait_for(poll_until_started(), 60)
    assert seen == sorted(seen, reverse=True), seen  # never up
    assert seen[0] >= 4 and len(seen) >= 3, seen  # four jobs ahead at first, and it fell in steps


# --- the SSE comment --------------------------------------------------------------------------------

# (route, body): every SSE dialect's streamed generation, and LMI's JSON lines (no comments)
SSE_STREAMS = [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "stream": True}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2,
                      "stream": True}),
    ("/v1/responses", {"input": "ab", "max_output_tokens": 2, "stream": True}),
    ("/generate_stream", {"inputs": "ab", "parameters": {"max_new_tokens": 2}}),
]


@pytest.mark.parametrize(("path", "body"), SSE_STREAMS, ids=[s[0] for s in SSE_STREAMS])
async def test_a_waiting_stream_says_where_it_stands_until_its_first_token(api, with_eta, path, body):
    client, settings = api
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        raw, chunks = bytearray(), resp.aiter_bytes()
        async for chunk in chunks:
            raw.extend(chunk)
            if b"position=" in raw:
                break  # it waits, and says where: now a worker comes
        async with worker(settings):
            async for chunk in chunks:
                raw.extend(chunk)
    before, after = comments_before_data(bytes(raw))
    standings = [m for line in before if (m := STANDING.match(line))]
    assert standings, before
    assert all(line == b": keep-alive" or STANDING.match(line) for line in before), before
    assert all(line == b": keep-alive" for line in after), after  # started: plain keep-alives only
    assert with_eta  # the relay read the standing


async def test_jsonlines_streams_send_no_comments_while_waiting(api, with_eta):
    """LMI's JSON lines have no comment syntax: the standing is read, nothing is sent for it."""
    client, settings = api
    async with client.stream("POST", "/invocations", json={"inputs": "ab", "parameters": {"max_new_tokens": 2},
                                                           "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/jsonlines")
        await eventually(lambda: bool(with_eta), timeout_s=30, what="the relay to read the standing")
        async with worker(settings):
            raw = await resp.aread()
    assert raw and all(line.startswith(b"{") for line in raw.split(b"\n") if line), raw


async def test_the_streamed_standing_falls_as_the_queue_drains(api, with_eta):
    """Two slow jobs ahead, one slot: the waiting stream's positions and ETAs fall as each starts."""
    client, settings = api
    await queue_jobs(client, 2, max_tokens=40)
    body = {"prompt": "ab", "max_tokens": 2, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async with worker(settings, delay_s=0.07):  # 40 tokens: about 3 s a job, one standing read each 2 s
            raw = await resp.aread()
    before, _ = comments_before_data(raw)
    standings = [(int(m[1]), float(m[2])) for line in before if (m := STANDING.match(line))]
    positions = [p for p, _ in standings]
    assert positions == sorted(positions, reverse=True) and positions[0] > positions[-1], standings
    etas = [e for _, e in standings]
    assert etas == sorted(etas, reverse=True) and etas[0] > etas[-1], standings


# --- the SDK clients --------------------------------------------------------------------------------


async def waiting_then_served(settings: Settings, given: list[Standing], read) -> None:
    """Run ``read`` (the client's stream) while the job waits for a worker that starts once the
    relay has sent a standing or two, then serves it."""
    task = asyncio.create_task(read())
    await eventually(lambda: len(given) >= 2 or task.done(), timeout_s=30, what="standings sent")
    async with worker(settings):
        await asyncio.wait_for(task, 60)


async def test_the_openai_client_reads_a_stream_with_standings(api, with_eta):
    _, settings = api
    tee = Tee()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{settings.port}/v1", api_key="x",
                                http_client=httpx2.AsyncClient(transport=tee))
    texts: list[str] = []

    async def read() -> None:
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}],
                                                      max_tokens=2, stream=True)
        async for chunk in stream:
            texts.extend(c.delta.content or "" for c in chunk.choices)

    await waiting_then_served(settings, with_eta, read)
    assert "".join(texts)  # the scripted tokens, parsed after the comments
    before, _ = comments_before_data(bytes(tee.seen))
    assert any(STANDING.match(line) for line in before), before


async def test_the_anthropic_client_reads_a_stream_with_standings(api, with_eta):
    _, settings = api
    tee = Tee()
    client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{settings.port}", api_key="x",
                                      http_client=httpx2.AsyncClient(transport=tee))
    texts: list[str] = []

    async def read() -> None:
        async with client.messages.stream(model="tiny", max_tokens=2,
                                          messages=[{"role": "user", "content": "ab"}]) as stream:
            async for text in stream.text_stream:
                texts.append(text)
            final = await stream.get_final_message()
            assert final.stop_reason == "max_tokens"

    await waiting_then_served(settings, with_eta, read)
    assert "".join(texts)
    before, _ = comments_before_data(bytes(tee.seen))
    assert any(STANDING.match(line) for line in before), before


async def test_the_huggingface_hub_client_reads_a_stream_with_standings(api, with_eta, monkeypatch):
    """TGI's stream through ``InferenceClient`` (synchronous: in a thread, as a user's script would).
    Its HTTP client is not one to tap, so the comments are recorded as the server renders them."""
    _, settings = api
    sent: list[bytes] = []

    def recorded(tick):
        sent.append(comment(tick))
        return sent[-1]

    monkeypatch.setattr(RENDERERS, "comment", recorded)
    hub = InferenceClient(model=f"http://127.0.0.1:{settings.port}")
    texts: list[str] = []

    async def read() -> None:
        def call() -> None:
            texts.extend(hub.text_generation("ab", max_new_tokens=2, stream=True))
        await asyncio.to_thread(call)

    await waiting_then_served(settings, with_eta, read)
    assert "".join(texts) == expected_text("ab", 2)
    assert any(STANDING.match(frame.rstrip(b"\n")) for frame in sent), sent
