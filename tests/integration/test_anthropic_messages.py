"""Anthropic Messages through the real ``anthropic`` SDK, on a real port, real Redis and a
scripted engine: what the SDK builds from our bytes (message, stream accumulator, errors).

The engine answers a chat with its last message's characters cycled (``"abc"`` with
``max_tokens: 4`` gives ``"abca"``); here it also honours stop strings (as vLLM does: the text
ends before the match, which is the stop reason) and ends a prompt starting with ``eos`` after
its fourth token as an EOS would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import anthropic
import msgspec
import pytest
from transformers import AutoTokenizer

from api.dialects import anthropic_messages as am
from api.dialects.anthropic_render import signature
from shared.events import TokenDelta, ToolCallDelta
from shared.schemas import GenerationRequest, Tool, ToolUse
from tests.support.dialect_bodies import anthropic_bodies
from tests.support.event_log import read_job_sse, sse_frames
from tests.support.fuzzing import draw, malformed_bodies, struct_body
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.streams import chunked
from tests.support.waiting import job_status
from workers.protocol import Step

SLOW_S = 1.6  # a "slow..." chat waits this long before its first token: several keep-alive intervals
EOS_AFTER = 4
MAX_TOKENS = 32
FUZZ_EXAMPLES = 40


class MessagesEngine(ScriptedEngine):
    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        if req.messages is None:  # the worker's warm-up
            async for step in super().steps(job_id, req, replay):
                yield step
            return
        prompt = req.messages[-1].content or "a"
        if prompt == CALL_TOOLS:
            for step in _calls(job_id, len(prompt)):
                await asyncio.sleep(self.delay_s)
                yield step
            return
        if prompt in ("fail", "break"):
            async for step in super().steps(job_id, msgspec.structs.replace(req, messages=None, prompt=prompt)):
                yield step
            return
        if prompt.startswith("slow"):
            await asyncio.sleep(SLOW_S)
        n = min(req.sampling.max_tokens, MAX_TOKENS)  # fuzzed bodies ask for thousands
        text = "".join(prompt[i % len(prompt)] for i in range(n))
        if prompt.startswith("eos"):
            text = text[:EOS_AFTER]
        # vLLM holds text back while it may still become a stop string: the match never streams.
        match = min(((text.find(s), s) for s in req.sampling.stop if s in text), default=None)
        out = text if match is None else text[:match[0]]
        for i, char in enumerate(out):
            await asyncio.sleep(self.delay_s)
            last = match is None and i == len(out) - 1
            finish = ("stop" if len(out) < n else "length") if last else None
            yield Step(deltas=[TokenDelta(token_ids=[ord(char)], text=char, finish_reason=finish)], finished=last,
                       prompt_tokens=len(prompt))
        if match is not None:  # the token that completed the stop string: no text of its own
            yield Step(deltas=[TokenDelta(token_ids=[0], text="", finish_reason="stop", stop_reason=match[1])],
                       finished=True, prompt_tokens=len(prompt))


CALL_TOOLS = "call tools"  # a chat whose last message says this is answered as a parsed model would
WEATHER = {"name": "get_weather", "description": "The weather in a city", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _calls(job_id: str, prompt_tokens: int) -> list[Step]:
    """What the worker publishes for a parsed answer (workers/parsing.py): reasoning, content, then
    two calls with the worker's ids, their arguments in pieces across steps."""
    def call(index: int, arguments: str = "", first: bool = False) -> ToolCallDelta:
        return ToolCallDelta(index=index, id=f"call_{job_id}_{index}" if first else None,
                             name="get_weather" if first else None, arguments=arguments)
    deltas = [TokenDelta(token_ids=[1], reasoning="Two "), TokenDelta(token_ids=[2], reasoning="cities."),
              TokenDelta(token_ids=[3], text="Checking."), TokenDelta(token_ids=[4], tool_calls=[call(0, first=True)]),
              TokenDelta(token_ids=[5], tool_calls=[call(0, '{"city": ')]),
              TokenDelta(token_ids=[6], tool_calls=[call(0, '"Paris"}'), call(1, '{"city":', first=True)]),
              TokenDelta(token_ids=[7], tool_calls=[call(1, '"Rome"}')], finish_reason="tool_calls")]
    return [Step(deltas=[d], finished=d.finish_reason is not None, prompt_tokens=prompt_tokens) for d in deltas]


# One stack for the module: tests/integration/conftest.py
pytestmark = pytest.mark.stack(MessagesEngine(delay_s=0.001), prefix="scripted-anthropic")


def client_of(stack, **kwargs) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                                    **kwargs)


async def test_create_returns_a_message_the_sdk_parses(stack):
    client = client_of(stack)
    msg = await client.messages.create(model="tiny", max_tokens=5, system="be brief",
                                       messages=[{"role": "user", "content": "abc"}])
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [(b.type, b.text) for b in msg.content] == [("text", "abcab")]
    assert msg.model == "tiny"
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)
    assert (msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.service_tier) == (3, 5, "standard")


async def test_stop_sequences_and_end_turn(stack):
    client = client_of(stack)
    msg = await client.messages.create(model="tiny", max_tokens=10, stop_sequences=["ca"],
                                       messages=[{"role": "user", "content": "abc"}])
    assert msg.content[0].text == "ab"
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "ca")
    msg = await client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "eos"}])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == ("eose", "end_turn", None)


async def test_sampling_fields_arrive_through_extra_body_and_tiers_set_priority(stack):
    client = client_of(stack)
    msg = await client.messages.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": [{"type": "text", "text": "xyz"}]}],
        service_tier="auto", metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7, "service_tier": "priority"},
    )
    assert msg.content[0].text == "xyz" and msg.usage.service_tier == "priority"
    queued = stack.worker.engine.requests[-1]
    assert (queued.sampling.temperature, queued.sampling.top_p, queued.sampling.top_k) == (0.5, 0.9, 7)
    assert queued.priority == -1 and queued.dialect == "anthropic_messages"
    await client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                 extra_body={"service_tier": "flex"})
    assert stack.worker.engine.requests[-1].priority == 2


async def test_stream_accumulates_the_same_text_as_create(stack):
    client = client_of(stack)
    body = dict(model="tiny", max_tokens=7, messages=[{"role": "user", "content": "hello"}])
    created = await client.messages.create(**body)
    async with client.messages.stream(**body) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == created.content[0].text == "hellohe"
    # One text_delta per token event: as many as the job's log holds (steps made while the worker's
    # flusher was behind share one).
    events = sse_frames(await read_job_sse(stack.client, final.id.removeprefix("msg_")))
    texts = ["".join(d.get("text", "") for d in json.loads(f.split(b"data: ", 1)[1]).get("deltas", [])) for f in events]
    assert pieces == chunked(texts, "hellohe")
    assert (final.stop_reason, final.stop_sequence) == (created.stop_reason, created.stop_sequence)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (created.usage.input_tokens, 7)
    assert final.id.startswith("msg_") and final.id != created.id


async def test_stream_with_a_stop_sequence(stack):
    client = client_of(stack)
    async with client.messages.stream(model="tiny", max_tokens=10, stop_sequences=["ca"],
                                      messages=[{"role": "user", "content": "abc"}]) as stream:
        final = await stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == ("ab", "stop_sequence", "ca")


async def test_stream_events_in_order_with_keepalive_comments(stack):
    """The raw events, in Anthropic's order; a slow start sends SSE comments first, which the SDK
    ignores (its stream of the same request still parses)."""
    body = {"model": "tiny", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "slow"}]}
    async with stack.client.stream("POST", "/v1/messages", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = await resp.aread()
    assert raw.startswith(b": keep-alive\n\n")
    frames = [f for f in raw.split(b"\n\n") if f and not f.startswith(b":")]
    names = [f.split(b"\n")[0].removeprefix(b"event: ").decode() for f in frames]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    datas = [json.loads(f.split(b"\n")[1].removeprefix(b"data: ")) for f in frames]
    assert all(d["type"] == name for d, name in zip(datas, names, strict=True))
    assert [d["delta"]["text"] for d in datas if d["type"] == "content_block_delta"] == ["s", "l"]
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"] == {"input_tokens": 4, "output_tokens": 2}
    async with client_of(stack).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
        assert (await stream.get_final_message()).content[0].text == "sl"


async def test_error_after_the_stream_started_is_an_error_event(stack):
    body = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "break"}]}
    async with stack.client.stream("POST", "/v1/messages", json=body) as resp:
        raw = await resp.aread()
    assert resp.status_code == 200
    last = raw.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ")
    assert json.loads(last.split(b"\n")[1].removeprefix(b"data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "scripted failure mid-stream"}}
    with pytest.raises(anthropic.APIStatusError, match="scripted failure mid-stream"):
        async with client_of(stack).messages.stream(model="tiny", max_tokens=5,
                                                    messages=[{"role": "user", "content": "break"}]) as stream:
            await stream.get_final_message()


async def test_errors_before_the_stream_get_anthropic_statuses_and_sdk_classes(stack):
    client = client_of(stack)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as nf:
        await client.messages.create(model="no-such-model", max_tokens=2, messages=user)
    assert nf.value.body["error"]["type"] == "not_found_error" and nf.value.body["type"] == "error"
    refusals = [
        dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
        dict(messages=user, tools=[{"name": "t"}]),  # a custom tool needs its input_schema
        dict(messages=user, thinking={"type": "enabled", "budget_tokens": 1024}),  # not below max_tokens
        dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "t", "input": {}}]}]),
        dict(messages=[{"role": "tool", "content": "x"}]),
    ]
    for extra in refusals:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="tiny", max_tokens=2, **extra)
        assert bad.value.body["error"]["type"] == "invalid_request_error", extra
    # A refusal of a streamed request is a real status too: nothing was streamed yet.
    with pytest.raises(anthropic.BadRequestError):
        async with client.messages.stream(model="tiny", max_tokens=2, messages=user, tools=[{"name": "t"}]) as s:
            await s.get_final_message()
    with pytest.raises(anthropic.BadRequestError):  # the engine refuses it before any token
        await client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "fail"}])


async def test_count_tokens_renders_the_chat_template_as_the_worker_does(stack):
    """The API's tokenizer and the model's own template: the count equals an independent render
    of the same conversation (system first, text blocks joined with newlines)."""
    client = client_of(stack)
    counted = await client.messages.count_tokens(
        model="tiny", system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                  {"role": "assistant", "content": "three"}, {"role": "user", "content": "four"}])
    tok = AutoTokenizer.from_pretrained(stack.settings.model_path)
    expected = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "one\ntwo"},
                                        {"role": "assistant", "content": "three"},
                                        {"role": "user", "content": "four"}], tokenize=True,
                                       add_generation_prompt=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert counted.input_tokens == len(expected) > 10
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           tools=[{"name": "t"}])


async def test_count_tokens_with_tools_and_tool_history(stack):
    """Tools and a tool round (``?beta=true``, as Claude Code calls it): the count is the template's
    render of the same tools and the same turns in OpenAI's form, the result's failure marked."""
    counted = await client_of(stack).beta.messages.count_tokens(
        model="tiny", tools=[WEATHER], betas=["interleaved-thinking-2025-05-14"],
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "Paris.", "signature": "x"},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no network", "is_error": True},
                      {"type": "text", "text": "and now?"}]}])
    tok = AutoTokenizer.from_pretrained(stack.settings.model_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER["input_schema"]}}]
    expected = tok.apply_chat_template([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning": "Paris.", "tool_calls": [{
            "id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Error: no network", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and now?"}], tools=tools, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert counted.input_tokens == len(expected) > 10


async def test_respond_async_queues_a_job_to_poll(stack):
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "ab"}]}
    resp = await stack.client.post("/v1/messages", headers={"Prefer": "respond-async"}, json=body)
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    job = await job_status(stack.client, job_id, "done")
    # The stored job's result is rendered in the dialect that queued it: an Anthropic message.
    assert job["result"]["type"] == "message" and job["result"]["content"] == [{"type": "text", "text": "aba"}]
    assert job["result"]["id"] == f"msg_{job_id}"


async def test_api_keys_arrive_as_x_api_key(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, MessagesEngine(delay_s=0.001), api_keys="key-one") as s:
        user = [{"role": "user", "content": "ok"}]
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await client_of(s, api_key="wrong").messages.create(model="tiny", max_tokens=1, messages=user)
        assert denied.value.body == {"type": "error", "error": {
            "type": "authentication_error",
            "message": "Missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"}}
        msg = await client_of(s, api_key="key-one").messages.create(model="tiny", max_tokens=2, messages=user)
        assert msg.content[0].text == "ok"


async def test_full_queue_is_529_overloaded(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.1), max_num_seqs=1, max_queued=1) as s:
        resp = await s.client.post("/v1/jobs", json={"prompt": "hold", "sampling": {"max_tokens": 200}})
        assert resp.status_code == 202
        with pytest.raises(anthropic.OverloadedError) as over:
            await client_of(s).messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
        assert over.value.status_code == 529 and over.value.body["error"]["type"] == "overloaded_error"
        assert (await s.client.delete(f"/v1/jobs/{resp.json()['id']}")).status_code == 200


async def test_full_queue_529_says_when_to_retry(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.1), max_num_seqs=1, max_queued=1) as s:
        resp = await s.client.post("/v1/jobs", json={"prompt": "hold", "sampling": {"max_tokens": 200}})
        try:
            over = await s.client.post("/v1/messages", json={"model": "tiny", "max_tokens": 1,
                                                              "messages": [{"role": "user", "content": "x"}]})
            assert over.status_code == 529
            assert over.headers.get("retry-after") == "1"
        finally:
            await s.client.delete(f"/v1/jobs/{resp.json()['id']}")


async def test_malformed_bodies_get_invalid_request_errors(stack):
    for raw in (b"", b"{", b"\xef\xbb\xbf{}", b'{"model": "tiny", "max_tokens": NaN, "messages": []}',
                b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}',
                b'{"model": "tiny", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}',
                b'{"model": "tiny", "max_tokens": 1e400, "messages": []}', b"[" * 200 + b"]" * 200):
        resp = await stack.client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (raw[:40], resp.text)
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"



@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_fuzzed_bodies_never_get_a_5xx_or_hang(stack, route):
    """Generated bodies (valid and not) get an answer below 500, streams run to their end; the
    malformed ones (truncated, BOM, invalid UTF-8, NaN, too deep) get a 4xx in Anthropic's shape."""
    cases = [(b, False) for b in draw(anthropic_bodies, FUZZ_EXAMPLES)]
    cases += [(b, True) for b in draw(malformed_bodies(struct_body(am.MessagesRequest, wild=False)), FUZZ_EXAMPLES)]
    limit, failures = asyncio.Semaphore(8), []

    async def one(raw: bytes, malformed: bool) -> None:
        async with limit:
            try:
                async with asyncio.timeout(15):
                    async with stack.client.stream("POST", route, content=raw,
                                                   headers={"content-type": "application/json"}) as resp:
                        content = await resp.aread()
            except TimeoutError:
                failures.append(f"HANG {raw[:200]!r}")
                return
        bad = resp.status_code >= 500 or (malformed and not 400 <= resp.status_code < 500)
        if resp.status_code >= 400 and not bad:
            bad = json.loads(content)["type"] != "error"
        if bad:
            failures.append(f"{resp.status_code} {raw[:200]!r} -> {content[:300]!r}")

    await asyncio.gather(*(one(raw, malformed) for raw, malformed in cases))
    assert not failures, "\n".join(failures[:10])


async def test_count_tokens_serves_the_model_whose_tokenizer_the_api_holds(redis_url, prefix):
    """Another configured model is known (create queues for it) but its tokenizer is not here: a
    clear 404 rather than a count from the wrong tokenizer."""
    async with scripted_stack(redis_url, prefix, MessagesEngine(delay_s=0.001), models="tiny,other") as s:
        with pytest.raises(anthropic.NotFoundError, match="No tokenizer for `other` here"):
            await client_of(s).messages.count_tokens(model="other", messages=[{"role": "user", "content": "x"}])


# --- tool use and thinking ------------------------------------------------------------------------


def _blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or (b.id, b.name, b.input))
            for b in message.content]


def _expected(job_id: str) -> list[tuple]:
    return [("thinking", "Two cities."), ("text", "Checking."),
            ("tool_use", (f"toolu_{job_id}_0", "get_weather", {"city": "Paris"})),
            ("tool_use", (f"toolu_{job_id}_1", "get_weather", {"city": "Rome"}))]


async def test_create_with_tools_answers_thinking_text_and_calls(stack):
    client = client_of(stack)
    msg = await client.messages.create(model="tiny", max_tokens=64, tools=[WEATHER],
                                       tool_choice={"type": "auto", "disable_parallel_tool_use": False},
                                       messages=[{"role": "user", "content": CALL_TOOLS}])
    job_id = msg.id.removeprefix("msg_")
    assert _blocks(msg) == _expected(job_id) and msg.stop_reason == "tool_use"
    assert msg.content[0].signature == signature(job_id, 0)
    queued = stack.worker.engine.requests[-1]
    assert queued.tools == ToolUse(tools=[Tool(name="get_weather", description="The weather in a city",
                                               parameters=WEATHER["input_schema"])], choice="auto")
    # The same job read back later (the stored result) is the same message, signature and ids included.
    stored = (await stack.client.get(f"/v1/jobs/{job_id}")).json()["result"]
    assert anthropic.types.Message.model_validate(stored) == msg


async def test_stream_with_tools_in_anthropics_block_order(stack):
    """The raw events: each block opened, filled and closed before the next, the signature last
    in the thinking block; and the SDK's final message is the one ``create`` gives."""
    body = {"model": "tiny", "max_tokens": 64, "stream": True, "tools": [WEATHER],
            "messages": [{"role": "user", "content": CALL_TOOLS}]}
    async with stack.client.stream("POST", "/v1/messages", json=body) as resp:
        raw = await resp.aread()
    datas = [json.loads(f.split(b"\n")[1].removeprefix(b"data: ")) for f in raw.split(b"\n\n")
             if f and not f.startswith(b":")]
    steps = [(d["type"], d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for d in datas]
    # A block's deltas, one per token event: as many as the job had events (steps made while the
    # worker's flusher was behind share one), so a run of them counts once here; the pieces joined
    # are the final message's (below).
    steps = [s for n, s in enumerate(steps) if not (s[0] == "content_block_delta" and steps[n - 1] == s)]
    assert steps == [
        ("message_start", None, None), ("content_block_start", 0, "thinking"), ("ping", None, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert datas[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    joined: dict[int, str] = {}  # each block's pieces joined, however many there were
    for d in datas:
        if d["type"] == "content_block_delta" and d["delta"]["type"] != "signature_delta":
            piece = d["delta"].get("thinking") or d["delta"].get("text") or d["delta"]["partial_json"]
            joined[d["index"]] = joined.get(d["index"], "") + piece
    assert [joined[0], joined[1], json.loads(joined[2]), json.loads(joined[3])] == [
        "Two cities.", "Checking.", {"city": "Paris"}, {"city": "Rome"}]
    async with client_of(stack).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
        final = await s.get_final_message()
    assert _blocks(final) == _expected(final.id.removeprefix("msg_")) and final.stop_reason == "tool_use"


async def test_a_tool_round_trip_through_the_beta_endpoint(stack):
    """Claude Code's loop: the answer's blocks sent back as the assistant turn with the results
    (``/v1/messages?beta=true``, an ``anthropic-beta`` header): each call and its result reach
    the template with the same id, the thinking as the turn's reasoning."""
    client = client_of(stack)
    first = await client.messages.create(model="tiny", max_tokens=64, tools=[WEATHER],
                                         messages=[{"role": "user", "content": CALL_TOOLS}])
    calls = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": [{"type": "text", "text": "sunny"}],
                "cache_control": {"type": "ephemeral"}} for c in calls]
    again = await client.beta.messages.create(
        model="tiny", max_tokens=3, tools=[WEATHER], betas=["interleaved-thinking-2025-05-14"],
        thinking={"type": "adaptive"}, output_config={"effort": "low"},
        messages=[{"role": "user", "content": CALL_TOOLS},
                  {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": results}])
    assert again.content[0].text == "sun" and again.stop_reason == "max_tokens"
    queued = stack.worker.engine.requests[-1]
    assistant, *tool_turns = queued.messages[1:]
    assert [c.id for c in assistant.tool_calls] == [m.tool_call_id for m in tool_turns] == [c.id for c in calls]
    assert [c.arguments for c in assistant.tool_calls] == ['{"city":"Paris"}', '{"city":"Rome"}']
    assert (assistant.content, assistant.reasoning) == ("Checking.", "Two cities.")
    assert queued.chat.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}


async def test_a_claude_code_request(stack):
    """What Claude Code sends (system blocks with the billing header and cache_control, a system
    turn inside messages, adaptive thinking, context_management, metadata, its beta headers):
    served, with the billing header left out."""
    body = {
        "model": "tiny", "max_tokens": 1024, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.160.a1b; cc_entrypoint=cli;"},
                   {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "<system-reminder>be brief</system-reminder>"},
                     {"role": "user", "content": "ok"}],
        "tools": [WEATHER], "thinking": {"type": "adaptive", "budget_tokens": 0},
        "metadata": {"user_id": "user_1_account_2_session_3"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
               "anthropic-version": "2023-06-01", "user-agent": "claude-cli/2.1.160 (external, cli)"}
    async with stack.client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as resp:
        raw = await resp.aread()
    assert resp.status_code == 200, raw
    assert raw.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    queued = stack.worker.engine.requests[-1]
    assert [(m.role, m.content) for m in queued.messages] == [
        ("system", "You are Claude Code."), ("user", "hi"), ("system", "<system-reminder>be brief</system-reminder>"),
        ("user", "ok")]
