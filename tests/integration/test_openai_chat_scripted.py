"""Chat completions on a real port, real Redis and a scripted engine: exact wire bytes.

The scripted engine answers a chat with its last message's characters cycled (``"abc"`` with
``max_tokens: 4`` gives ``"abca"``), so every frame is known in advance. LMI's chat on
``/invocations`` is mounted here on a test route that calls ``chat_response(..., lmi=True)``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import httpx
import msgspec
import pytest
from litestar import Request, Response, post
from litestar.response import Stream

from api.context import Ctx
from api.dialects import openai_chat as chat
from api.errors import answered_in
from api.routes.openai_chat import chat_response
from api.services import Svc
from shared.schemas import GenerationRequest
from tests.support.scripted_engine import ScriptedEngine
from tests.support.streams import chunked
from tests.support.waiting import job_status
from workers.protocol import Step

SLOW_S = 1.6  # a "slow..." chat waits this long before its first token: several keep-alive intervals


class ChatEngine(ScriptedEngine):
    """The scripted engine, reading a chat's last message as its prompt (``break`` fails after
    its first token, as there); ``slow...`` waits before its first token."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        if req.messages is not None:
            req = msgspec.structs.replace(req, messages=None, prompt=req.messages[-1].content)
        if req.prompt.startswith("slow"):
            await asyncio.sleep(SLOW_S)
        async for step in super().steps(job_id, req, replay):
            yield step


@post("/test/lmi-chat", opt={"dialect": "lmi"}, status_code=200)
async def lmi_chat(request: Request, svc: Svc, ctx: Ctx) -> Response | Stream:
    """What ``/invocations`` does with a body that has ``messages`` (api/routes/lmi.py)."""
    return await answered_in(chat.NAME, chat_response(request, svc, ctx.as_dialect(chat.NAME), lmi=True))


# One stack for the module (tests/integration/conftest.py), with LMI's chat route too.
pytestmark = pytest.mark.stack(ChatEngine(delay_s=0.001), prefix="scripted-chat", routes=[lmi_chat])


@pytest.fixture(scope="module")
def client(stack):
    return stack.client


def chat_body(text: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": "ignored"}, {"role": "user", "content": text}], **extra}


async def raw_stream(client, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    async with client.stream("POST", path, json=body) as resp:
        return resp, await resp.aread()


def without_keepalives(raw: bytes) -> bytes:
    """The stream's bytes less its keep-alive comments, which a loaded box can send before a first
    token slower than the stack's 0.5 s interval (a CI simulation saw one): the rest is exact."""
    return b"".join(f + b"\n\n" for f in raw.split(b"\n\n")[:-1] if f != b": keep-alive")


def head_of(raw: bytes, prefix: bytes = b"data: ") -> bytes:
    """The chunks' common start, from the first chunk (the job id and created are not known ahead)."""
    first = json.loads(raw.split(b"\n")[0].removeprefix(prefix))
    assert first["id"].startswith("chatcmpl-") and first["model"] == "tiny"
    return b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"tiny",' % (
        first["id"].encode(),
        first["created"],
    )


ROLE = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'


def content(text: str, finish: str | None = None) -> bytes:
    tail = (
        b'"finish_reason":null}]}'
        if finish is None
        else b'"finish_reason":"%s","stop_reason":null}]}' % finish.encode()
    )
    return b'"choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,' % text.encode() + tail


async def test_stream_is_role_chunk_then_deltas_then_usage_then_done(client):
    body = chat_body("abc", max_tokens=4, stream=True, stream_options={"include_usage": True})
    resp, raw = await raw_stream(client, "/v1/chat/completions", body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    raw = without_keepalives(raw)
    head = head_of(raw)
    usage = b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
    # The content chunks as they came (between the role chunk and the usage chunk): as many as the
    # job had events, so the bytes expected are rendered from those pieces.
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in raw.split(b"\n\n")[1:-3]]
    *pieces, last = chunked([c["choices"][0]["delta"]["content"] for c in chunks], "abca")
    expected = [ROLE, *(content(p) for p in pieces), content(last, "length"), usage]
    assert raw == b"".join(b"data: " + head + x + b"\n\n" for x in expected) + b"data: [DONE]\n\n"


async def test_non_streaming_chat_completion(client):
    resp = await client.post("/v1/chat/completions", json=chat_body("xy", max_completion_tokens=3, model="tiny"))
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    out = resp.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion" and out["model"] == "tiny"
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "xyx"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_done_follows_an_in_band_error(client):
    resp, raw = await raw_stream(client, "/v1/chat/completions", chat_body("break", stream=True))
    assert resp.status_code == 200  # the first token went out before the failure
    raw = without_keepalives(raw)
    head = head_of(raw)
    error = (
        b'data: {"error":{"message":"scripted failure mid-stream","type":"InternalServerError","param":null,'
        b'"code":500}}\n\n'
    )
    assert (
        raw
        == b"data: " + head + ROLE + b"\n\n" + b"data: " + head + content("b") + b"\n\n" + error + b"data: [DONE]\n\n"
    )


async def test_errors_before_the_first_byte_get_real_statuses_in_openai_shape(client):
    resp = await client.post("/v1/chat/completions", json=chat_body("fail", stream=True))
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {"message": "scripted failure", "type": "BadRequestError", "param": None, "code": 400}
    }
    resp = await client.post("/v1/chat/completions", json=chat_body("x", n=2, temperature=0))
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": "n must be 1 when using greedy sampling, got 2.",
        "type": "BadRequestError",
        "param": "n",
        "code": 400,
    }
    resp = await client.post("/v1/chat/completions", json=chat_body("x", temperature=3))
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]["message"]
    resp = await client.post("/v1/chat/completions", content=b'{"messages": [')
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/v1/chat/completions", json=chat_body("x", model="other"))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == 404


async def test_keepalive_comments_while_waiting_then_the_chunks(client):
    resp, raw = await raw_stream(client, "/v1/chat/completions", chat_body("slow", max_tokens=2, stream=True))
    frames = raw.split(b"\n\n")
    comments = [f for f in frames if f.startswith(b":")]
    assert comments and set(comments) == {b": keep-alive"}
    assert frames.index(comments[-1]) < 1 + len(comments)  # all of them before the first chunk
    data = [f for f in frames if f.startswith(b"data: ")]
    assert data[0].endswith(ROLE) and data[-1] == b"data: [DONE]"


async def test_lmi_chat_streams_json_lines_without_done_or_keepalives(client):
    resp, raw = await raw_stream(client, "/test/lmi-chat", chat_body("slow", max_tokens=2, stream=True))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/jsonlines")
    head = head_of(raw, prefix=b"")
    assert raw == b"".join(head + x + b"\n" for x in (ROLE, content("s"), content("l", "length")))


async def test_lmi_chat_non_streaming_and_errors_in_openai_shape(client):
    resp = await client.post("/test/lmi-chat", json=chat_body("ab", max_tokens=2))
    assert resp.status_code == 200 and resp.json()["object"] == "chat.completion"
    assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    resp = await client.post("/test/lmi-chat", json=chat_body("x", top_logprobs=3))
    assert resp.status_code == 400  # the route speaks LMI, but a chat body errs in the OpenAI shape
    assert resp.json()["error"]["message"] == "when using `top_logprobs`, `logprobs` must be set to true."
    resp, raw = await raw_stream(client, "/test/lmi-chat", chat_body("break", stream=True))
    last = json.loads(raw.split(b"\n")[-2])
    assert last == {
        "error": {"message": "scripted failure mid-stream", "type": "InternalServerError", "param": None, "code": 500}
    }
    assert raw.endswith(b"}\n") and b"[DONE]" not in raw


async def test_fire_and_poll_renders_the_finished_job_as_a_chat_completion(client):
    resp = await client.post(
        "/v1/chat/completions", json=chat_body("job", max_tokens=4), headers={"Prefer": "respond-async"}
    )
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    job = await job_status(client, job_id, "done")
    result = job["result"]
    assert result["id"] == f"chatcmpl-{job_id}" and result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "jobj"}
