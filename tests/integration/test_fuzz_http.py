"""Hypothesis-generated bodies POSTed over a real socket to every generation route.

The app runs on a real port with a scripted worker. Every response must have a status below
500 and must finish (streams are read to the end) within a per-request timeout; a body never
carries an internal error in-band either. Bodies come from the same strategies as the unit
fuzz tests (tests/fuzzing.py). The worker must still be alive at the end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.schemas import GenerationRequest
from tests.scripted_engine import ScriptedEngine, Step
from tests.scripted_stack import scripted_stack
from tests.unit import test_fuzz_dialects as fz

EXAMPLES = 60
REQUEST_TIMEOUT_S = 10.0
CONCURRENCY = 8


class CappedEngine(ScriptedEngine):
    """At most a few tokens per job, whatever max_tokens says: fuzzed bodies ask for thousands."""

    async def stream(self, job_id: str, req: GenerationRequest) -> AsyncIterator[Step]:
        sampling = msgspec.structs.replace(req.sampling, max_tokens=min(req.sampling.max_tokens, 4))
        async for step in super().stream(job_id, msgspec.structs.replace(req, sampling=sampling)):
            yield step


def draw(strategy: st.SearchStrategy[bytes], n: int = EXAMPLES) -> list[bytes]:
    """n examples of ``strategy``, drawn by hypothesis (outside any event loop concern: sync)."""
    out: list[bytes] = []

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def collect(body: bytes) -> None:
        out.append(body)

    collect()
    return out


# (route, strategy of bodies)
ROUTES = [
    ("/v1/completions", fz.completion_bodies),
    ("/v1/chat/completions", fz.chat_bodies),
    ("/invocations", st.one_of(fz.lmi_bodies, fz.completion_bodies, fz.chat_bodies)),
    ("/predictions/tiny", fz.lmi_bodies),
    ("/generate", fz.tgi_bodies),
    ("/generate_stream", fz.tgi_bodies),
    ("/", fz.tgi_bodies),
    ("/v2/models/tiny/generate", fz.triton_bodies),
    ("/v2/models/tiny/generate_stream", fz.triton_bodies),
    ("/v1/generate", fz.happy_bodies),
    ("/v1/generate_stream", fz.happy_bodies),
    ("/v1/jobs", fz.job_bodies),
]


@pytest.fixture(scope="module")
async def stack(redis_url):
    async with scripted_stack(redis_url, "fuzz-http", CappedEngine(delay_s=0.0)) as s:
        yield s


async def post(stack, route: str, body: bytes) -> tuple[int, bytes]:
    headers = {"content-type": "application/json"}
    async with stack.client.stream("POST", route, content=body, headers=headers) as resp:
        return resp.status_code, await resp.aread()


@pytest.mark.parametrize("route,strategy", ROUTES, ids=[r[0] for r in ROUTES])
async def test_fuzzed_bodies_never_500_or_hang(stack, route, strategy):
    bodies = draw(strategy)
    limit = asyncio.Semaphore(CONCURRENCY)
    failures: list[str] = []
    statuses: dict[int, int] = {}

    async def one(body: bytes) -> None:
        async with limit:
            try:
                status, content = await asyncio.wait_for(post(stack, route, body), REQUEST_TIMEOUT_S)
            except TimeoutError:
                failures.append(f"HANG ({REQUEST_TIMEOUT_S}s) body={body[:300]!r}")
                return
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500 or b"internal server error" in content or b"internal_error" in content:
            failures.append(f"{status} body={body[:300]!r} response={content[:300]!r}")

    await asyncio.gather(*(one(b) for b in bodies))
    print(f"\n[fuzz-http] {route}: sent={len(bodies)} statuses={dict(sorted(statuses.items()))}")
    assert not failures, f"{len(failures)} of {len(bodies)} failed:\n" + "\n".join(failures[:10])
    # The worker survived everything it was sent, and still answers.
    status, content = await asyncio.wait_for(
        post(stack, "/v1/completions", b'{"prompt": "ok", "max_tokens": 2}'), REQUEST_TIMEOUT_S)
    assert status == 200, content


async def test_lmtp_fuzzed_frames_never_break_the_socket(stack):
    """Fuzzed LMTP frames on one WebSocket: each gets an answer or nothing, the socket stays up,
    and a valid GENERATE afterwards still streams to the end."""
    frames = draw(fz.lmtp_frames.map(str.encode))
    url = stack.url.replace("http", "ws") + "/"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        for frame in frames:
            await ws.send_str(frame.decode())
        await ws.send_str('GENERATE {"stream_id": 424242, "prompt": [97, 98], "max_tokens": 2}')
        ends = 0
        async with asyncio.timeout(30):
            while ends == 0:
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                assert "internal server error" not in msg.data, msg.data
                verb, _, payload = msg.data.partition(" ")
                items = json.loads(payload)
                ends += sum(1 for item in (items if isinstance(items, list) else [items])
                            if verb == "TOKEN" and item.get("stream_id") == 424242 and item.get("finish_reason"))
        assert not ws.closed
