"""Anthropic Messages: translation of every field, every refusal, the service-tier mapping, and
the exact bytes of the message, each stream event and each error."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from api.dialects import anthropic_messages as am
from api.dialects.tiers import priority_of_tier
from api.submit import check_queueable
from shared import json_input
from shared.codec import decode_request, encode
from shared.errors import (
    DeadlineExceeded,
    GenerationFailed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    QueueUnavailable,
    ServiceError,
    Unauthorized,
)
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import KEEPALIVE, Keepalive
from shared.queue import level_of
from shared.schemas import ChatMessage, Choice, JobResult, StructuredOutput, Usage
from tests.support.dialect_bodies import anthropic_bodies
from tests.support.streams import frames as rendered

HI = [{"role": "user", "content": "hi"}]


def body(**fields) -> am.MessagesRequest:
    return msgspec.convert({"model": "claude", "max_tokens": 8, "messages": HI, **fields}, am.MessagesRequest)


def req(**fields):
    return am.to_generation_request(body(**fields))


def refused(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        req(**fields)
    return info.value


async def frames(r, events, **kw) -> list[bytes]:
    return await rendered(am.MessageStream(r, "j1", **kw), events)


# --- translation ----------------------------------------------------------------------------------


def test_defaults():
    r = req()
    s = r.sampling
    assert r.messages == [ChatMessage(role="user", content="hi")] and r.prompt is None
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.structured) == (1.0, 1.0, 0, 8, [], None)
    assert r.chat.add_generation_prompt and not r.chat.continue_final_message
    assert (r.model, r.dialect, r.priority) == ("claude", "anthropic_messages", None)


def test_every_field_is_mapped():
    r = req(temperature=0.2, top_p=0.5, top_k=40, stop_sequences=["\n\nHuman:", "END"],
            metadata={"user_id": "user-7f3a"}, stream=True, service_tier="priority")
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop) == (0.2, 0.5, 40, ["\n\nHuman:", "END"])
    assert r.priority == -1
    assert b"user-7f3a" not in encode(r)  # metadata.user_id goes nowhere


def test_system_and_text_blocks_and_turns():
    blocks = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": blocks}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    r = req(system=[{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}], messages=messages)
    assert r.messages == [ChatMessage(role="system", content="s1\ns2"), ChatMessage(role="user", content="a\nb\nc"),
                          ChatMessage(role="assistant", content="d"), ChatMessage(role="user", content="e")]
    assert req(system="sys").messages[0] == ChatMessage(role="system", content="sys")
    assert req(system="").messages == [ChatMessage(role="user", content="hi")]  # an empty system is no turn


def test_a_last_assistant_turn_is_continued():
    r = req(messages=[*HI, {"role": "assistant", "content": "The answer is ("}])
    assert r.messages[-1] == ChatMessage(role="assistant", content="The answer is (")
    assert not r.chat.add_generation_prompt and r.chat.continue_final_message


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = req(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.sampling.structured == StructuredOutput(json=schema)
    assert req(output_config={}).sampling.structured is None


@pytest.mark.parametrize("tier,priority", [(None, None), ("auto", None), ("standard_only", None),
                                           ("default", None), ("priority", -1), ("flex", 2)])
def test_service_tier(tier, priority):
    r = req(service_tier=tier)
    assert r.priority == priority
    assert am.reported_tier(r) == ("priority" if tier == "priority" else "standard")
    assert am.render_result(r, result("x", "stop"), "j1", 7).usage.service_tier == am.reported_tier(r)


def test_priority_of_tier():
    assert [priority_of_tier(t) for t in (None, "default", "auto", "flex", "priority")] == [None, None, None, 2, -1]
    assert (level_of(priority_of_tier("priority")), level_of(None), level_of(priority_of_tier("flex"))) == (0, 0, 2)
    with pytest.raises(InvalidRequest) as info:
        priority_of_tier("scale")
    assert info.value.param == "service_tier" and "'scale'" in info.value.message


@pytest.mark.parametrize("fields,message", [
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0: content blocks of type `image` are not supported by this server (text only)"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "`document`"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "`tool_use`"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]), "`tool_result`"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text: Field required"),
    (dict(system=[{"type": "image"}]), "system.0: content blocks of type `image`"),
    (dict(tools=[{"name": "f", "input_schema": {}}]), "tools: tool use is not supported by this server"),
    (dict(tool_choice={"type": "auto"}), "tool_choice: tool use is not supported"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking: extended thinking is not supported"),
    (dict(thinking={"type": "adaptive"}), "thinking: extended thinking is not supported"),
    (dict(output_config={"effort": "high"}), "output_config.effort"),
    (dict(output_config={"format": {"type": "xml"}}), "output_config.format.type: Input should be 'json_schema'"),
    (dict(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema: Field required"),
    (dict(messages=[]), "messages: at least one message is required"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages.0.role: Input should be 'user' or 'assistant'"),
    (dict(stop_sequences=[""]), "stop_sequences: each stop sequence must be a non-empty string"),
    (dict(service_tier="scale"), "service_tier must be one of"),
])
def test_refusals(fields, message):
    assert message in refused(**fields).message


def test_harmless_forms_of_refused_fields_are_accepted():
    r = req(tools=[], tool_choice={"type": "none"}, thinking={"type": "disabled"}, container=None, speed="standard")
    assert r.messages == [ChatMessage(role="user", content="hi")]


@pytest.mark.parametrize("fields", [dict(temperature=1.5), dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.1),
                                    dict(top_k=-1), dict(max_tokens=0), dict(model=None), dict(messages=None)])
def test_ranges_and_required_fields_fail_validation(fields):
    with pytest.raises(msgspec.ValidationError):
        body(**fields)


def test_count_tokens_body_is_the_create_body_without_max_tokens():
    count = msgspec.convert({"model": "claude", "messages": HI, "system": "s"}, am.CountTokensRequest)
    chat, options = am.chat_of(count)
    assert chat == [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="hi")]
    assert options.add_generation_prompt
    assert (chat, options) == (req(system="s").messages, req(system="s").chat)


# --- the message ----------------------------------------------------------------------------------


def result(text: str, finish: str, stop_reason: str | int | None = None) -> JobResult:
    return JobResult(choices=[Choice(text=text, finish_reason=finish, stop_reason=stop_reason)],
                     usage=Usage(prompt_tokens=12, completion_tokens=3))


def test_render_result_bytes():
    r = msgspec.structs.replace(req(), model="tiny")
    assert encode(am.render_result(r, result("Hi!", "stop"), "j1", 7)) == (
        b'{"id":"msg_j1","type":"message","role":"assistant","content":[{"type":"text","text":"Hi!"}],'
        b'"model":"tiny","stop_reason":"end_turn","stop_sequence":null,'
        b'"usage":{"input_tokens":12,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
        b'"cache_creation":null,"output_tokens":3,"output_tokens_details":null,"server_tool_use":null,'
        b'"service_tier":"standard","inference_geo":null}}'
    )


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("stop", None, ("end_turn", None)),
    ("stop", 7, ("end_turn", None)),  # a stop token id (the model's other EOS ids) ends the turn
    ("stop", "END", ("stop_sequence", "END")),
    ("length", None, ("max_tokens", None)),
])
def test_stop_reasons(finish, stop_reason, expected):
    msg = am.render_result(req(), result("x", finish, stop_reason), "j1", 7)
    assert (msg.stop_reason, msg.stop_sequence) == expected


def test_the_sdk_parses_the_message():
    from anthropic.types import Message

    msg = Message.model_validate_json(encode(am.render_result(req(), result("x", "length"), "j1", 7)))
    assert (msg.content[0].text, msg.stop_reason, msg.usage.input_tokens, msg.usage.service_tier) == (
        "x", "max_tokens", 12, "standard")


# --- the stream -----------------------------------------------------------------------------------


MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_j1","type":"message",'
    b'"role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":0,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
    b'"cache_creation":null,"output_tokens":1,"output_tokens_details":null,"server_tool_use":null,'
    b'"service_tier":"standard","inference_geo":null}}}\n\n'
)
BLOCK_START = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
               b'"content_block":{"type":"text","text":""}}\n\n')
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def text_delta(text: bytes) -> bytes:
    return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"' + text + b'"}}\n\n')


def message_delta(stop_reason: bytes, stop_sequence: bytes, inputs: int, outputs: int) -> bytes:
    return (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":' + stop_reason
            + b',"stop_sequence":' + stop_sequence + b'},"usage":{"input_tokens":%d,"output_tokens":%d}}\n\n'
            % (inputs, outputs))


async def test_stream_bytes_in_anthropics_order():
    r = msgspec.structs.replace(req(), model="tiny")
    events = [
        Keepalive(),
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="He")]),
        Tokens(seq=2, deltas=[TokenDelta(token_ids=[6], text="")]),  # no text yet: no delta
        Keepalive(),
        Done(seq=3, deltas=[TokenDelta(token_ids=[7], text="llo", finish_reason="stop", stop_reason="END")],
             usage=Usage(prompt_tokens=9, completion_tokens=3)),
    ]
    assert await frames(r, events) == [
        KEEPALIVE, MESSAGE_START, BLOCK_START, PING, text_delta(b"He"), KEEPALIVE, text_delta(b"llo"), BLOCK_STOP,
        message_delta(b'"stop_sequence"', b'"END"', 9, 3), MESSAGE_STOP,
    ]


async def test_stream_that_ends_at_once():
    """A job whose only event is its Done still opens and closes the message."""
    r = msgspec.structs.replace(req(), model="tiny")
    done = Done(seq=1, deltas=[TokenDelta(token_ids=[2], text="", finish_reason="stop")],
                usage=Usage(prompt_tokens=4, completion_tokens=1))
    assert await frames(r, [done]) == [MESSAGE_START, BLOCK_START, PING, BLOCK_STOP,
                                       message_delta(b'"end_turn"', b"null", 4, 1), MESSAGE_STOP]
    length = Done(seq=1, deltas=[TokenDelta(token_ids=[2], text="x", finish_reason="length")],
                  usage=Usage(prompt_tokens=4, completion_tokens=1))
    assert (await frames(r, [length]))[-2] == message_delta(b'"max_tokens"', b"null", 4, 1)


ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
         b'"message":"engine broke"}}\n\n')


async def test_an_error_mid_stream_is_one_error_event_that_ends_it():
    r = msgspec.structs.replace(req(), model="tiny")
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")]),
              Error(seq=2, code=GenerationFailed.code, message="engine broke", status=500),
              Tokens(seq=3, deltas=[TokenDelta(token_ids=[5], text="never")])]
    assert await frames(r, events) == [MESSAGE_START, BLOCK_START, PING, text_delta(b"a"), ERROR]


async def test_a_relay_failure_is_an_error_event_too():
    async def broken():
        yield Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")])
        raise QueueUnavailable("the queue is unavailable")

    r = msgspec.structs.replace(req(), model="tiny")
    out = await rendered(am.MessageStream(r, "j1"), broken())
    assert out[-1] == (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                       b'"message":"the queue is unavailable"}}\n\n')


async def test_the_sdk_accumulates_the_stream():
    """The SDK's own SSE decoder and accumulator over our bytes, keep-alive comments included."""
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    r = msgspec.structs.replace(req(), model="tiny")
    events = [Keepalive(), Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="He")]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[7], text="y", finish_reason="length")],
                   usage=Usage(prompt_tokens=9, completion_tokens=2))]
    raw = b"".join(await frames(r, events))
    adapter, snapshot = TypeAdapter(RawMessageStreamEvent), None
    for sse in SSEDecoder().iter_bytes(iter([raw])):
        if sse.event == "ping":
            continue
        snapshot = accumulate_event(event=adapter.validate_python(sse.json()), current_snapshot=snapshot,
                                    json_bufs={})
    assert snapshot.content[0].text == "Hey" and snapshot.stop_reason == "max_tokens"
    assert (snapshot.usage.input_tokens, snapshot.usage.output_tokens) == (9, 2)


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc,status,kind", [
    (InvalidRequest("bad"), 400, "invalid_request_error"),
    (Unauthorized("who"), 401, "authentication_error"),
    (ModelNotFound("nope"), 404, "not_found_error"),
    (PayloadTooLarge("big"), 413, "request_too_large"),
    (Overloaded("full"), 529, "overloaded_error"),
    (GenerationFailed("boom"), 500, "api_error"),
    (QueueUnavailable("down"), 503, "api_error"),
    (DeadlineExceeded("late"), 504, "timeout_error"),
    (ServiceError("x"), 500, "api_error"),
])
def test_error_statuses_and_types(exc, status, kind):
    got, err = am.error_body(exc)
    assert got == status
    assert encode(err) == b'{"type":"error","error":{"type":"%s","message":"%s"}}' % (kind.encode(),
                                                                                       exc.message.encode())


def test_a_429_other_than_the_full_queue_is_a_rate_limit():
    exc = ServiceError("slow down")
    exc.status, exc.code = 429, "rate_limited"
    assert am.error_body(exc)[0] == 429 and am.error_body(exc)[1].error.type == "rate_limit_error"
    exc.status, exc.code = 405, "http_error"  # Litestar's own 4xx keep their status
    assert am.error_body(exc)[0] == 405 and am.error_body(exc)[1].error.type == "invalid_request_error"


# --- fuzzing: any body is a request or a 4xx ------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(anthropic_bodies)
def test_any_body_translates_or_is_refused_with_a_4xx(raw: bytes):
    try:
        try:
            b = json_input.decode(raw, json_input.decoder_for(am.MessagesRequest))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidRequest(str(exc)) from None
        r = am.to_generation_request(b)
        check_queueable(r)
    except ServiceError as exc:
        assert 400 <= exc.status < 500, exc.message
        return
    assert decode_request(encode(r)) == r
