"""Images on real vLLM (docs/images.md): two workers serve ``tiny-vision`` (a random-weight Idefics3
built offline) behind one API, and the real clients send what they send: the openai SDK (chat with a
data URL and with a URL the API fetches from a local server allowed by ``LLMQ_MEDIA_ALLOW``,
Responses with ``input_image``), the anthropic SDK (a base64 image, an image inside a
``tool_result``), and Claude Code's and Codex's captured requests with a screenshot added. A worker
SIGKILLed mid-answer about an image is continued exactly; the egress guard refuses a metadata
address before any connection and a redirect to a loopback address it does not allow; the limits
are the dialects' 400s; a conversation of three turns stores its screenshot once; and the
text-only tiny model refuses an image with OpenAI's 400."""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.support.agent_clis import FIXTURES
from tests.support.crash_stack import Items, Small, small_stack, sse_events, stream_and_kill
from tests.support.event_log import ended_record

pytestmark = [pytest.mark.e2e]

MODEL = "tiny-vision"


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of a fixed pattern (``seed`` changes it, so its hash)."""
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7 + seed) % 256, (y * 13 + seed) % 256, (x * y + seed) % 256)
                 for y in range(height) for x in range(width)])
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class _Images(BaseHTTPRequestHandler):
    """A local image server: ``/cat.png`` is an image, ``/hop`` redirects to ``Location`` from the
    query (``/hop?to=<url>``); every request is counted."""

    served: dict[str, bytes] = {}
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        if self.path.startswith("/hop?to="):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/hop?to="))
            self.end_headers()
            return
        body = self.served.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[tuple[str, type[_Images]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    _Images.served = {"/cat.png": png(40, 30, seed=3)}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Images
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    logs = tmp_path_factory.mktemp("images-logs")
    prefix = f"img-{uuid.uuid4().hex[:6]}"
    with small_stack(redis_url, logs, prefix, LLMQ_MODEL=MODEL, LLMQ_MEDIA_ALLOW="127.0.0.1",
                     LLMQ_MAX_MODEL_LEN="32768") as stack:
        stack.model = MODEL
        yield stack


@pytest.fixture(scope="module")
def oai(small: Small) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{small.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(small: Small) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=small.url, api_key="x", max_retries=0, timeout=120) as client:
        yield client


def stored(small: Small) -> list[bytes]:
    return list(small.redis.scan_iter(match=small.keys.media("*"), count=1000))


SHOT = png(64, 48, seed=1)


def user_turn(text: str, image: bytes = SHOT) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": data_url(image)}}]}


def test_openai_chat_answers_about_a_data_url_image_with_its_tokens_counted(small: Small, oai: openai.OpenAI):
    text_only = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "what is this?"}],
                                            max_tokens=4, temperature=0)
    with_image = oai.chat.completions.create(model=MODEL, messages=[user_turn("what is this?")], max_tokens=4,
                                             temperature=0)
    assert with_image.choices[0].finish_reason in ("stop", "length")
    # The image is more than its placeholder: tiles and the global image (docs/images.md).
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens + 4
    record = ended_record(small.redis, small.keys, MODEL, with_image.id.removeprefix("chatcmpl-"))
    request = json.loads(record[b"request"])
    (image,) = [p for m in request["messages"] for p in m.get("parts", ()) if p["type"] == "image"]
    assert set(image) >= {"sha256", "format", "width", "height", "tokens"} and "url" not in image
    assert (image["format"], image["width"], image["height"]) == ("png", 64, 48)


def test_the_api_fetches_an_allowed_url_once_and_the_worker_reads_it_by_hash(small, oai, images):
    base, server = images
    before = len(server.hits)
    url = f"{base}/cat.png"
    answer = oai.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                               {"type": "text", "text": "and this?"}]}])
    assert answer.choices[0].message.content is not None
    assert server.hits[before:] == ["/cat.png"]


def test_the_egress_guard_refuses_a_metadata_address_and_a_redirect_outside_the_allow_list(small, oai, images):
    base, server = images
    before = len(server.hits)
    hop = f"/hop?to=http://127.0.0.2:{base.rsplit(':', 1)[1]}/cat.png"  # loopback, not in the allow list
    for url in ("http://169.254.169.254/latest/meta-data/", f"{base}{hop}"):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        assert refused.value.status_code == 400
    # The metadata address was never connected to; the redirect was read, its target never fetched.
    assert server.hits[before:] == [hop]


def test_responses_takes_input_image(oai: openai.OpenAI):
    response = oai.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "describe"},
                                     {"type": "input_image", "image_url": data_url(SHOT), "detail": "auto"}]}])
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 20


def test_anthropic_base64_and_an_image_inside_a_tool_result(claude: anthropic.Anthropic):
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(SHOT).decode()}
    first = claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "what is it?"}]}])
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.input_tokens > 20
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}]
    second = claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, tools=tools, messages=[
        {"role": "user", "content": "look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": source}]}]}])
    assert second.usage.input_tokens > first.usage.input_tokens
    counted = claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "what is it?"}]}])
    assert counted.input_tokens == first.usage.input_tokens


def test_a_stream_says_what_the_synchronous_answer_says(oai: openai.OpenAI):
    body = {"model": MODEL, "messages": [user_turn("tell me a story")], "max_tokens": 24, "temperature": 0}
    whole = oai.chat.completions.create(**body)
    pieces = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(**body, stream=True)
              if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content


def test_the_limits_are_the_dialects_400s(small: Small, oai: openai.OpenAI, claude: anthropic.Anthropic):
    too_wide = png(8001, 1)
    with pytest.raises(openai.BadRequestError, match="8000"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[user_turn("hi", too_wide)])
    big = b"\x89PNG" + b"\0" * (5 * 2**20)  # past 5 MB before it is read as an image
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(big).decode()}}]}])
    with httpx.Client(timeout=60) as http:  # past LLMQ_MAX_BODY_BYTES: 413 before anything is read
        resp = http.post(f"{small.url}/v1/chat/completions", content=b"{" + b" " * (33 * 2**20) + b"}",
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 413


def test_a_conversation_that_resends_its_screenshot_stores_it_once(small: Small, oai: openai.OpenAI):
    shot = png(50, 50, seed=99)
    messages: list[dict] = []
    before = len(stored(small))
    for turn in range(3):
        messages.append(user_turn(f"turn {turn}", shot))
        answer = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    keys = stored(small)
    assert len(keys) == before + 1
    assert small.redis.strlen(small.keys.media(hashlib.sha256(shot).hexdigest())) == len(shot)


def test_a_worker_killed_mid_answer_about_an_image_is_continued_exactly(small: Small):
    small.two_workers()
    body = {"model": MODEL, "stream": True, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "messages": [user_turn("tell me everything")]}
    url = f"{small.url}/v1/chat/completions"

    def text(items: Items) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for _, c in items if c.get("choices"))
    with httpx.Client(timeout=120) as client:
        reference: Items = []
        sse_events(client, url, body, reference)
        killed = stream_and_kill(small, lambda items: sse_events(client, url, body, items))
    assert not [c for _, c in killed.items if "error" in c]
    assert text(killed.items) == text(reference) and text(reference)
    record = ended_record(small.redis, small.keys, MODEL, killed.job_id)
    assert record[b"status"] == b"done" and record[b"attempt"] == b"2", record


def _with_screenshot_claude(body: dict) -> dict:
    body = copy.deepcopy(body)
    body["model"] = MODEL
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(SHOT).decode()}
    last = body["messages"][-1] if body["messages"][-1]["role"] == "user" else body["messages"][0]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"].append({"type": "image", "source": source})
    body["max_tokens"] = 16
    return body


def _with_screenshot_codex(body: dict) -> dict:
    body = copy.deepcopy(body)
    body["model"] = MODEL
    body["max_output_tokens"] = 16
    user = next(i for i in reversed(body["input"]) if i.get("role") == "user")
    user["content"].append({"type": "input_image", "image_url": data_url(SHOT)})
    # Codex's view_image tool: its output is a list of input_text and input_image items.
    body["input"] += [
        {"type": "function_call", "call_id": "call_view", "name": "view_image",
         "arguments": json.dumps({"path": "shot.png"})},
        {"type": "function_call_output", "call_id": "call_view",
         "output": [{"type": "input_text", "text": "shot.png"}, {"type": "input_image", "image_url": data_url(SHOT)}]}]
    return body


@pytest.mark.parametrize(("name", "path", "add"), [("claude_code", "/v1/messages?beta=true", _with_screenshot_claude),
                                                   ("codex", "/v1/responses", _with_screenshot_codex)])
def test_agent_clis_captured_turns_with_a_screenshot_are_answered(small: Small, name: str, path: str, add) -> None:
    captured = json.loads((FIXTURES / f"{name}_request.json").read_text())["request"]
    body = add(captured["body"])
    headers = {k: v for k, v in captured["headers"].items()
               if k.lower() in ("anthropic-version", "anthropic-beta", "openai-beta", "user-agent")}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{small.url}{path}", json=body, headers=headers) as resp:
            raw = resp.read()
    assert resp.status_code == 200, raw[:2000]
    # The turn's end: Messages' stop, or Responses' end (incomplete: the 16 tokens asked for ran out).
    assert raw.endswith((b'data: {"type":"message_stop"}\n\n',)) or b'"type":"response.completed"' in raw \
        or b'"type":"response.incomplete"' in raw, raw[-2000:]
    assert b'"type":"error"' not in raw


def test_a_text_only_model_refuses_an_image_with_its_dialects_400(client: openai.OpenAI, stack) -> None:
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=stack.model, max_tokens=2, messages=[user_turn("hi")])

