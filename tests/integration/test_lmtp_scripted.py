"""LMTP over a real WebSocket (aiohttp, as LMQL connects), real Redis and a scripted engine:
exact frames, stream multiplexing, error frames, SCORE, and cancel-on-close.

The engine below scripts its own tokens on top of the shared scripted engine: it reports
logprobs, top logprobs, prompt logprobs and several tokens per step, which LMTP needs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest

from shared.codec import job_from_hash
from shared.errors import InvalidRequest
from shared.events import TokenDelta
from shared.keys import Keys
from shared.schemas import GenerationRequest, PromptInfo, Slo, TopLogprob
from tests.support.scripted_engine import ScriptedEngine
from workers.protocol import Step

PREFIX = "lmtp-scripted"
MODEL = "tiny"
FAIL, SLOW, TAIL, EOS_AFTER = 666, 999, 4, 3  # prompt markers the engine obeys
EOS = 2
# Alternatives the engine ranks around the sampled token: token 5 always beats it.
ALTERNATIVES = [(5, -0.25), (6, -1.5), (7, -2.0)]
SAMPLED_LOGPROB = -0.5


def sampled(ids: list[int], i: int, bias: dict[int, float]) -> int:
    """Token i of a generation: 10 + (len(prompt) + i) % 20, steered by a +-100 mask."""
    allowed = sorted(t for t, b in bias.items() if b >= 100)
    if allowed:
        return allowed[i % len(allowed)]
    token = 10 + (len(ids) + i) % 20
    while bias.get(token, 0.0) <= -100:
        token += 1
    return token


def top(token: int, k: int) -> list[TopLogprob]:
    ranked = sorted([*ALTERNATIVES, (token, SAMPLED_LOGPROB)], key=lambda x: -x[1])
    return [TopLogprob(t, "", lp) for t, lp in ranked[:k]]


def prompt_logprob(position: int) -> float:
    return -0.125 * position


class LmtpEngine(ScriptedEngine):
    """Two tokens per step; prompt markers: first id FAIL fails, SLOW sleeps per step, last id
    TAIL ends with a token-less final step, EOS_AFTER emits EOS as the third token."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        ids = list(req.prompt_token_ids or [ord(c) for c in req.prompt or "x"])
        if ids[0] == FAIL:
            raise InvalidRequest("scripted failure")
        s = req.sampling
        info = None
        if req.output.prompt_tokens:
            info = PromptInfo(token_ids=ids, logprobs=[None, *(prompt_logprob(p) for p in range(1, len(ids)))])
        tokens = [sampled(ids, i, s.logit_bias) for i in range(s.max_tokens)]
        reason = "length"
        if ids[-1] == EOS_AFTER and len(tokens) >= 3:
            tokens, reason = [*tokens[:2], EOS], "stop"
        chunks = [tokens[i : i + 2] for i in range(0, len(tokens), 2)]
        for n, chunk in enumerate(chunks):
            if ids[0] == SLOW:
                await asyncio.sleep(0.05)
            last = n == len(chunks) - 1 and ids[-1] != TAIL
            yield Step(
                deltas=[self._delta(chunk, s.logprobs, reason if last else None)],
                finished=last,
                prompt_tokens=len(ids),
                prompt=info if n == 0 else None,
            )
        if ids[-1] == TAIL:
            yield Step(deltas=[TokenDelta(finish_reason=reason)], finished=True, prompt_tokens=len(ids))

    @staticmethod
    def _delta(chunk: list[int], k: int | None, reason: str | None) -> TokenDelta:
        delta = TokenDelta(token_ids=chunk, text="", finish_reason=reason)
        if k is not None:
            delta.logprobs, delta.token_texts = [SAMPLED_LOGPROB] * len(chunk), [""] * len(chunk)
            delta.top_logprobs = [top(t, k) for t in chunk] if k else None
        return delta


# One stack for the module: tests/integration/conftest.py
pytestmark = pytest.mark.stack(LmtpEngine(), prefix=PREFIX, served_model_name=MODEL, heartbeat_s=0.5)


@pytest.fixture(scope="module")
def stack(stack):
    """The module's stack as the (url, redis, worker) these tests unpack."""
    return stack.url, stack.redis, stack.worker


async def exchange(url: str, messages: list[str], count: int) -> list[str]:
    """Send the messages, then read ``count`` text frames."""
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        for m in messages:
            await ws.send_str(m)
        return [await asyncio.wait_for(ws.receive_str(), 10) for _ in range(count)]


def generate(stream_id: int, prompt: list[int], **kw) -> str:
    return "GENERATE " + json.dumps({"model": MODEL, "prompt": prompt, "stream_id": stream_id, **kw})


def payloads(frames: list[str], verb: str = "TOKEN") -> list[dict]:
    out = []
    for f in frames:
        head, _, body = f.partition(" ")
        assert head == verb, f
        [payload] = json.loads(body)
        out.append(payload)
    return out


async def test_generate_frames_exact_bytes(stack):
    url, _, _ = stack
    frames = await exchange(url, [generate(1, [1, 9], max_tokens=3)], 3)
    assert frames == [
        'TOKEN [{"token": 12, "stream_id": 1, "logprob": -0.5, "finish_reason": null, '
        '"top_logprobs": {"12": -0.5, "5": -0.25}}]',
        'TOKEN [{"token": 13, "stream_id": 1, "logprob": -0.5, "finish_reason": null, '
        '"top_logprobs": {"13": -0.5, "5": -0.25}}]',
        'TOKEN [{"token": 14, "stream_id": 1, "logprob": -0.5, "finish_reason": "length", '
        '"top_logprobs": {"14": -0.5, "5": -0.25}}]',
    ]


async def test_defaults_are_32_tokens_and_finish_rides_on_the_last_token(stack):
    url, _, _ = stack
    # TAIL: the job's final event carries no token, so the last token must be held back for it.
    out = payloads(await exchange(url, ['GENERATE {"prompt": [1, 4], "stream_id": 7}'], 32))
    assert [p["finish_reason"] for p in out] == [None] * 31 + ["length"]
    assert [p["token"] for p in out] == [10 + (2 + i) % 20 for i in range(32)]
    assert all(p["stream_id"] == 7 for p in out)


async def test_eos_ends_the_stream_with_stop(stack):
    url, _, _ = stack
    out = payloads(await exchange(url, [generate(1, [1, EOS_AFTER], max_tokens=8)], 3))
    assert [(p["token"], p["finish_reason"]) for p in out] == [(12, None), (13, None), (EOS, "stop")]


async def test_top_logprobs_k_and_masked_alternatives_dropped(stack):
    url, _, _ = stack
    # k=3 without a mask: the engine's best three, plus the sampled token first.
    [p] = payloads(await exchange(url, [generate(1, [1, 9], max_tokens=1, top_logprobs=3)], 1))
    assert list(p["top_logprobs"].items()) == [("12", -0.5), ("5", -0.25), ("6", -1.5)]
    # LMQL's deny mask bans token 5: it must not outrank the sampled token in top_logprobs.
    [p] = payloads(await exchange(url, [generate(1, [1, 9], max_tokens=1, logit_bias={"5": -100})], 1))
    assert p["top_logprobs"] == {"12": -0.5}
    # An allow mask (+100 on the allowed set) steers sampling and drops every other alternative.
    [p] = payloads(
        await exchange(url, [generate(1, [1, 9], max_tokens=1, top_logprobs=2, logit_bias={"40": 100, "41": 100})], 1)
    )
    assert p["token"] == 40 and p["top_logprobs"] == {"40": -0.5}


async def test_top_logprobs_zero_reports_the_sampled_token_only(stack):
    url, _, _ = stack
    [p] = payloads(await exchange(url, [generate(1, [1, 9], max_tokens=1, top_logprobs=0)], 1))
    assert p == {"token": 12, "stream_id": 1, "logprob": -0.5, "finish_reason": "length", "top_logprobs": {"12": -0.5}}


async def test_two_streams_interleave_each_in_order(stack):
    url, _, _ = stack
    msgs = [generate(1, [SLOW, 1], max_tokens=6), generate(2, [SLOW, 1, 1], max_tokens=6)]
    out = payloads(await exchange(url, msgs, 12))
    by_stream = {sid: [p for p in out if p["stream_id"] == sid] for sid in (1, 2)}
    assert [p["token"] for p in by_stream[1]] == [10 + (2 + i) % 20 for i in range(6)]
    assert [p["token"] for p in by_stream[2]] == [10 + (3 + i) % 20 for i in range(6)]
    for stream in by_stream.values():
        assert [p["finish_reason"] for p in stream] == [None] * 5 + ["length"]
    order = [p["stream_id"] for p in out]
    assert order.index(2) < len(order) - 1 - order[::-1].index(1), order  # stream 2 began before 1 ended


async def test_score_streams_one_token_per_scored_token(stack):
    url, _, _ = stack
    msg = "SCORE " + json.dumps({"model": MODEL, "prompt": [1, 20, 21], "scored": [30, 31, 32], "stream_id": 4})
    frames = await exchange(url, [msg], 3)
    assert frames == [
        'TOKEN [{"token": 30, "stream_id": 4, "logprob": -0.375, "finish_reason": null}]',
        'TOKEN [{"token": 31, "stream_id": 4, "logprob": -0.5, "finish_reason": null}]',
        'TOKEN [{"token": 32, "stream_id": 4, "logprob": -0.625, "finish_reason": "stop"}]',
    ]


async def test_score_from_the_first_token_reports_zero_for_it(stack):
    url, _, _ = stack
    msg = "SCORE " + json.dumps({"model": MODEL, "prompt": [], "scored": [1, 30], "stream_id": 2})
    out = payloads(await exchange(url, [msg], 2))
    assert [(p["token"], p["logprob"], p["finish_reason"]) for p in out] == [(1, 0.0, None), (30, -0.125, "stop")]


async def test_model_info_is_a_msg_reply(stack):
    url, _, _ = stack
    msg = "MODEL_INFO " + json.dumps({"stream_id": 3, "model": MODEL, "data": {"model": MODEL}})
    [p] = payloads(await exchange(url, [msg], 1), "MSG")
    assert p["stream_id"] == 3
    assert p["model_info"]["model"] == MODEL and p["model_info"]["model_type"] == "llmq"
    assert p["model_info"]["ready_workers"] == 1


@pytest.mark.parametrize(
    ("message", "verb", "expected"),
    [
        (generate(5, [1, 2], model="nope"), "TOKEN", {"stream_id": 5, "error": "The model `nope` does not exist."}),
        (
            "MODEL_INFO " + json.dumps({"stream_id": 5, "model": "nope"}),
            "MSG",
            {"stream_id": 5, "error": "The model `nope` does not exist."},
        ),
        (generate(5, [FAIL, 2]), "TOKEN", {"stream_id": 5, "error": "scripted failure"}),
        ('FROB {"stream_id": 5}', "MSG", {"stream_id": 5, "error": "Unknown command: FROB"}),
        (
            'GENERATE {"prompt": [1], "stream_id": "x"}',
            "MSG",
            {"stream_id": "x", "error": "GENERATE needs an integer `stream_id`"},
        ),
    ],
)
async def test_errors_are_addressed_frames(stack, message, verb, expected):
    url, _, _ = stack
    [p] = payloads(await exchange(url, [message], 1), verb)
    assert p == expected


@pytest.mark.parametrize(
    ("message", "verb", "fragment"),
    [
        (generate(6, [1, 2], temperature=5.0), "TOKEN", "Expected `float` <= 2.0 - at `$.temperature`"),
        (generate(6, [1, 2], top_logprobs=21), "TOKEN", "Expected `int` <= 20 - at `$.top_logprobs`"),
        (generate(6, []), "TOKEN", "at `$.prompt`"),
        ("SCORE " + json.dumps({"prompt": [1], "scored": [], "stream_id": 6}), "TOKEN", "at `$.scored`"),
        ("GENERATE {not json", "MSG", "malformed JSON in GENERATE message"),
        ("GENERATE", "MSG", "malformed LMTP message"),
    ],
)
async def test_bad_payloads_get_error_frames(stack, message, verb, fragment):
    url, _, _ = stack
    [p] = payloads(await exchange(url, [message], 1), verb)
    assert fragment in p["error"], p
    assert set(p) == {"stream_id", "error"}


async def test_socket_survives_errors_and_serves_the_next_stream(stack):
    url, _, _ = stack
    frames = await exchange(url, ["FROB {}", generate(1, [1, 9], max_tokens=1)], 2)
    assert frames[0] == 'MSG [{"stream_id": null, "error": "Unknown command: FROB"}]'
    assert payloads(frames[1:])[0]["token"] == 12


async def find_job(redis, prompt: list[int]):
    keys = Keys(PREFIX)
    async for key in redis.scan_iter(match=keys.job(MODEL, "*")):
        record = job_from_hash(await redis.hgetall(key))
        if record.request.prompt_token_ids == prompt:
            return record
    return None


async def test_closing_the_socket_cancels_its_jobs(stack):
    url, redis, worker = stack
    prompt = [SLOW, 77, 78]
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        await ws.send_str(generate(1, prompt, max_tokens=400))
        first = json.loads((await asyncio.wait_for(ws.receive_str(), 10)).partition(" ")[2])
        assert first[0]["finish_reason"] is None
    for _ in range(200):
        record = await find_job(redis, prompt)
        if record is not None and record.status == "cancelled":
            break
        await asyncio.sleep(0.05)
    assert record is not None and record.status == "cancelled", record
    assert record.error is not None and record.error.code == "cancelled"
    assert record.id in worker.engine.aborted


async def test_the_upgrades_slo_headers_are_every_streams_slo(stack):
    # LMTP's commands have no field for them: the WebSocket upgrade's headers hold for the socket.
    url, redis, _ = stack
    prompts = [[1, 61], [1, 62]]
    headers = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "50"}
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=headers) as ws:
        for stream_id, prompt in enumerate(prompts, 1):
            await ws.send_str(generate(stream_id, prompt, max_tokens=1))
        frames = [await asyncio.wait_for(ws.receive_str(), 10) for _ in prompts]
    assert all(p["finish_reason"] == "length" for p in payloads(frames))
    for prompt in prompts:
        record = await find_job(redis, prompt)
        assert record is not None and record.request.slo == Slo(ttft_ms=60000, tpot_ms=50)
        assert record.first_token_deadline == record.queued_at + 60000


async def test_a_bad_slo_header_at_the_upgrade_is_each_streams_error(stack):
    url, _, _ = stack
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers={"x-slo-ttft-ms": "0"}) as ws:
        await ws.send_str(generate(1, [1, 63], max_tokens=1))
        frame = await asyncio.wait_for(ws.receive_str(), 10)
    [payload] = payloads([frame])
    assert payload["stream_id"] == 1 and "x-slo-ttft-ms" in payload["error"]
