"""Hypothesis-generated bodies POSTed over a real socket to every generation route.

The app runs on a real port with a scripted worker. Every response must have a status below
500 and must finish (streams are read to the end) within a per-request timeout; a body never
carries an internal error in-band either. Bodies come from the same strategies as the unit
fuzz tests (tests/support/dialect_bodies.py, tests/support/fuzzing.py). The worker must still be alive at the end.

Below JSON: raw bytes per route (``test_raw_bytes_...``), mutations of valid bodies under any
content type. A malformed body (truncated, a BOM, invalid UTF-8, NaN, nesting past the limit,
empty) must get a 4xx, anything else a status below 500. The exact statuses and error shapes
of named bad bodies are pinned in test_malformed_input.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import strategies as st

from api.dialects import anthropic_messages as am
from api.dialects import lmi, lmtp, tgi
from api.dialects import openai_chat as chat
from api.dialects import openai_completions as oc
from api.dialects import openai_responses as resp
from shared.batches import BatchCreate
from shared.schemas import GenerationRequest
from tests.support.dialect_bodies import (
    anthropic_bodies,
    chat_bodies,
    completion_bodies,
    happy_bodies,
    job_bodies,
    lmi_bodies,
    lmtp_frames,
    message_batch_bodies,
    responses_bodies,
    tgi_bodies,
    triton_bodies,
)
from tests.support.fuzzing import draw, malformed_bodies, odd_bodies, struct_body
from tests.support.scripted_engine import CappedEngine

EXAMPLES = 60
RAW_EXAMPLES = 30  # per route and kind (malformed, odd)
REQUEST_TIMEOUT_S = 10.0
CONCURRENCY = 8



# (route, strategy of bodies)
ROUTES = [
    ("/v1/completions", completion_bodies),
    ("/v1/chat/completions", chat_bodies),
    ("/invocations", st.one_of(lmi_bodies, completion_bodies, chat_bodies)),
    ("/predictions/tiny", lmi_bodies),
    ("/generate", tgi_bodies),
    ("/generate_stream", tgi_bodies),
    ("/", tgi_bodies),
    ("/v2/models/tiny/generate", triton_bodies),
    ("/v2/models/tiny/generate_stream", triton_bodies),
    ("/v1/generate", happy_bodies),
    ("/v1/generate_stream", happy_bodies),
    ("/v1/jobs", job_bodies),
    ("/v1/messages", anthropic_bodies),
    ("/v1/messages/batches", message_batch_bodies),
    ("/v1/responses", responses_bodies),
]


pytestmark = pytest.mark.stack(CappedEngine(delay_s=0.0), prefix="fuzz-http")  # tests/integration/conftest.py


async def post(stack, route: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    headers = {"content-type": content_type} if content_type else {}
    async with stack.client.stream("POST", route, content=body, headers=headers) as resp:
        return resp.status_code, await resp.aread()


@pytest.mark.parametrize("route,strategy", ROUTES, ids=[r[0] for r in ROUTES])
async def test_fuzzed_bodies_never_500_or_hang(stack, route, strategy):
    bodies = draw(strategy, EXAMPLES)
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


def _valid(*examples: dict[str, Any], cls: type | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies to mutate: valid examples of the route, and (for a Struct schema) generated ones."""
    base = st.sampled_from(list(examples))
    return st.one_of(base, struct_body(cls, wild=False)) if cls is not None else base


_TGI = _valid({"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": True}},
              {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": {"properties": {}}}}},
              cls=tgi.GenerateRequest)
_TRITON = _valid({"text_input": "hi", "parameters": {"max_tokens": 2, "temperature": 0.5}},
                 {"text_input": ["hi"], "sampling_parameters": '{"max_tokens": 2}', "return_finish_reason": True})
_HAPPY = _valid({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "json_format": {"a": "string"}, "top_k": 3})
_COMPLETIONS = _valid({"prompt": "hi", "max_tokens": 2}, {"prompt": [1, 2], "n": 2, "logit_bias": {"5": 1.5}},
                      cls=oc.CompletionRequest)
_CHAT = _valid({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": [1]},
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
               cls=chat.ChatRequest)
RAW_ROUTES = [
    ("/v1/completions", _COMPLETIONS),
    ("/v1/chat/completions", _CHAT),
    ("/invocations", st.one_of(_valid({"inputs": "hi", "parameters": {"max_new_tokens": 2}}, cls=lmi.LmiRequest),
                               _COMPLETIONS, _CHAT)),
    ("/predictions/tiny", _valid({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}}, cls=lmi.LmiRequest)),
    ("/generate", _TGI),
    ("/generate_stream", _TGI),
    ("/", _TGI),
    ("/tokenize", None),  # malformed only: a valid body would load the tokenizer (seconds)
    ("/v2/models/tiny/generate", _TRITON),
    ("/v2/models/tiny/generate_stream", _TRITON),
    ("/v1/generate", _HAPPY),
    ("/v1/generate_stream", _HAPPY),
    ("/v1/jobs", _valid({"prompt": "hi", "sampling": {"max_tokens": 2}}, cls=GenerationRequest)),
    ("/v1/batches", _valid({"input_file_id": "file-none", "endpoint": "/v1/completions", "completion_window": "24h"},
                           cls=BatchCreate)),
    ("/v1/messages", _valid({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                            {"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
                             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                             "stop_sequences": ["x"], "stream": True}, cls=am.MessagesRequest)),
    ("/v1/messages/batches", _valid({"requests": [{"custom_id": "a", "params": {
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}]})),
    ("/v1/messages/count_tokens", None),  # malformed only: a valid body would load the tokenizer (seconds)
    ("/v1/responses", _valid({"model": "tiny", "input": "hi", "max_output_tokens": 2},
                             {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                       "text": "hi"}]}],
                              "instructions": "s", "stream": True, "max_output_tokens": 2},
                             cls=resp.ResponsesRequest)),
]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain", "", "application/octet-stream",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=xx"]


@pytest.mark.parametrize("route,objects", RAW_ROUTES, ids=[r[0] for r in RAW_ROUTES])
async def test_raw_bytes_get_4xx_never_5xx(stack, route, objects):
    """Malformed bytes get a 4xx, odd ones an answer below 500; the process serves on."""
    content_types = st.sampled_from(CONTENT_TYPES)
    malformed = draw(st.tuples(malformed_bodies(_TGI if objects is None else objects), content_types), RAW_EXAMPLES)
    odd = [] if objects is None else draw(st.tuples(odd_bodies(objects), content_types), RAW_EXAMPLES)
    limit = asyncio.Semaphore(CONCURRENCY)
    failures: list[str] = []
    statuses: dict[int, int] = {}

    async def one(body: bytes, content_type: str, must_be_4xx: bool) -> None:
        async with limit:
            try:
                status, content = await asyncio.wait_for(post(stack, route, body, content_type), REQUEST_TIMEOUT_S)
            except TimeoutError:
                failures.append(f"HANG ({REQUEST_TIMEOUT_S}s) body={body[:200]!r}")
                return
        statuses[status] = statuses.get(status, 0) + 1
        bad = status >= 500 or (must_be_4xx and not 400 <= status < 500) or b"internal server error" in content
        if bad:
            failures.append(f"{status} ({content_type!r}) body={body[:200]!r} response={content[:300]!r}")

    await asyncio.gather(*(one(b, ct, True) for b, ct in malformed), *(one(b, ct, False) for b, ct in odd))
    print(f"\n[fuzz-raw] {route}: malformed={len(malformed)} odd={len(odd)} statuses={dict(sorted(statuses.items()))}")
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:10])
    status, content = await asyncio.wait_for(
        post(stack, "/v1/completions", b'{"prompt": "ok", "max_tokens": 2}'), REQUEST_TIMEOUT_S)
    assert status == 200, content


async def test_lmtp_fuzzed_frames_never_break_the_socket(stack):
    """Fuzzed LMTP frames (text, and binary with any bytes) on one WebSocket: each gets an answer
    or nothing, the socket stays up, and a valid GENERATE afterwards still streams to the end."""
    frames = draw(lmtp_frames.map(str.encode), EXAMPLES)
    # Binary frames too: raw bytes, and mutated payloads (invalid UTF-8, BOM, deep, NaN, ...).
    binary = draw(st.one_of(st.binary(max_size=64), st.tuples(
        st.sampled_from([b"GENERATE ", b"SCORE ", b"MODEL_INFO ", b""]),
        st.one_of(malformed_bodies(struct_body(lmtp.Generate)), odd_bodies(struct_body(lmtp.Generate)))
    ).map(b"".join)), RAW_EXAMPLES)
    url = stack.url.replace("http", "ws") + "/"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        for frame in frames:
            await ws.send_str(frame.decode())
        for raw in binary:
            await ws.send_bytes(raw)
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
