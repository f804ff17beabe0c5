"""OpenAI Responses: translation of every field, every refusal, and the exact bytes of the objects
and stream events (validated against the openai SDK's own types, strictly)."""

from __future__ import annotations

import json

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList

from api.dialects import error_body as dialect_error_body
from api.dialects import openai_responses as r
from api.dialects import render_result as dialect_render_result
from api.dialects.tiers import priority_of_tier
from api.submit import check_queueable
from shared import json_input
from shared.codec import decode_request, encode
from shared.errors import GenerationFailed, InvalidRequest, JobNotFound, Overloaded, QueueUnavailable, ServiceError
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import KEEPALIVE, Keepalive
from shared.schemas import (
    ChatMessage,
    Choice,
    GenerationRequest,
    JobError,
    JobRecord,
    JobResult,
    Reported,
    StructuredOutput,
    Usage,
)
from tests.support.dialect_bodies import responses_bodies
from tests.support.fuzzing import single_field_bodies
from tests.support.streams import frames as rendered

MAX_LEN = 1024
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def body(**fields) -> r.ResponsesRequest:
    return msgspec.convert({"input": "hi", **fields}, r.ResponsesRequest)


def req(**fields):
    return r.to_generation_request(body(**fields), max_model_len=MAX_LEN)


def refused(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        req(**fields)
    return info.value


async def frames(events, echo=None, starting_after=-1) -> list[bytes]:
    echo = echo or r.echo_of_body(body(), "m")
    return await rendered(r.ResponseStream(echo, "j1", 7, starting_after=starting_after), events)


def parsed(frame: bytes) -> tuple[str, dict]:
    event, data = frame.split(b"\n", 1)
    assert event.startswith(b"event: ") and data.startswith(b"data: ") and data.endswith(b"\n\n")
    return event[7:].decode(), json.loads(data[6:])


# --- translation ----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_with_openai_defaults():
    g = req()
    assert g.messages == [ChatMessage(role="user", content="hi")] and g.prompt is None
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.max_tokens) == (1.0, 1.0, MAX_LEN - 1)
    assert g.sampling.structured is None and g.priority is None and g.dialect == "openai_responses"
    assert g.model == "" and g.chat.add_generation_prompt


def test_instructions_come_first_and_message_items_keep_their_roles():
    items = [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}]},
        {"role": "system", "content": "e"},
    ]
    g = req(input=items, instructions="be brief")
    assert g.messages == [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="a"),
                          ChatMessage(role="assistant", content="b"), ChatMessage(role="system", content="c\nd"),
                          ChatMessage(role="system", content="e")]


def test_sampling_fields_map_onto_the_job():
    g = req(model="tiny", temperature=0.2, top_p=0.9, max_output_tokens=17)
    assert (g.model, g.sampling.temperature, g.sampling.top_p, g.sampling.max_tokens) == ("tiny", 0.2, 0.9, 17)


def test_text_formats_map_to_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert req(text={"format": {"type": "text"}}).sampling.structured is None
    assert req(text={"format": {"type": "json_object"}}).sampling.structured == StructuredOutput(json_object=True)
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    assert req(text={"format": fmt}).sampling.structured == StructuredOutput(json=schema)
    assert req(text={"verbosity": "low"}).sampling.structured is None


def test_service_tier_sets_the_priority_level():
    # The mapping is tiers.py's, shared by every dialect with the field: flex lowest, priority ahead of default.
    assert req(service_tier="flex").priority == priority_of_tier("flex") == 2
    assert req(service_tier="priority").priority == priority_of_tier("priority") < 0
    assert req(service_tier="auto").priority is None and req(service_tier="default").priority is None
    assert refused(service_tier="scale").param == "service_tier"
    # The tier named is kept with the job, so a response read back reports it (auto runs as default).
    for tier, reported in (("priority", "priority"), ("flex", "flex"), ("auto", "default"), (None, "default")):
        g = req(service_tier=tier)
        assert g.output.service_tier == tier and r.echo_of_request(g).service_tier == reported


def test_max_output_tokens_past_the_context_is_queued_as_asked_for_the_worker_to_clamp():
    # Agent clients ask for a fixed budget whatever the model; vLLM's server clamps to the room
    # the prompt leaves, and so does llmq's worker (shared/budget.py). The echo repeats the ask.
    g = req(max_output_tokens=32000)
    assert g.sampling.max_tokens == 32000
    assert r.echo_of_request(decode_request(encode(g))).max_output_tokens == 32000


def test_accepted_fields_that_change_nothing_the_worker_runs():
    g = req(metadata={"a": "b"}, store=False, user="u", stream=True, background=False, tool_choice="none",
            parallel_tool_calls=True, reasoning={"effort": None}, truncation="disabled", include=[], tools=[])
    plain = req()
    # Only what the answers repeat differs: kept with the job for a later read.
    assert g.output.reported == Reported(metadata={"a": "b"}, user="u", store=False)
    assert msgspec.structs.replace(g, output=plain.output) == plain


def test_a_stored_job_reports_what_its_first_answer_did():
    fmt = {"type": "json_schema", "name": "ans", "schema": {"type": "object"}, "strict": True}
    fields = dict(model="m", instructions="be brief", metadata={"k": "v"}, user="u1", background=True,
                  text={"format": fmt}, max_output_tokens=9, service_tier="flex")
    g = req(**fields)
    stored = decode_request(encode(g))  # as a worker and a later poll read it back
    assert r.echo_of_request(stored) == r.echo_of_body(body(**fields), "m")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True, "store": False}, "background"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file",
                                                                                    "file_id": "f"}]}]},
     "input[0].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_refusals_name_their_param(fields, param):
    exc = refused(**fields)
    assert exc.param == param and exc.status == 400
    status, err = r.error_body(exc)
    assert status == 400 and json.loads(encode(err)) == {"error": {
        "message": exc.message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}}


def test_a_chained_request_has_the_previous_conversation_without_its_instructions():
    first = req(instructions="old rules", input=[{"role": "user", "content": "abc"}])
    history = r.history_of(first, JobResult(choices=[Choice(index=0, text="xyz")]))
    assert history == [ChatMessage(role="user", content="abc"), ChatMessage(role="assistant", content="xyz")]
    second = r.to_generation_request(body(input="next", instructions="new rules", previous_response_id="resp_1"),
                                     max_model_len=MAX_LEN, history=history)
    assert second.messages == [ChatMessage(role="system", content="new rules"), *history,
                               ChatMessage(role="user", content="next")]
    assert r.echo_of_request(second).previous_response_id == "resp_1"


@pytest.mark.parametrize("raw", [{"temperature": 3}, {"top_p": 0}, {"max_output_tokens": 0}, {"input": 5},
                                 {"metadata": {"a": 1}}, {"store": "yes"}])
def test_out_of_range_or_mistyped_fields_fail_decoding(raw):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"input": "x", **raw}, r.ResponsesRequest)


# --- the response object ----------------------------------------------------------------------


def echo(**fields) -> r.Echo:
    return r.echo_of_body(body(**fields), "m")


def test_the_finished_object_exact_and_valid_for_the_sdk():
    result = JobResult(choices=[Choice(text="Hey", finish_reason="stop")], usage=Usage(prompt_tokens=3,
                                                                                      completion_tokens=2))
    e = echo(instructions="sys", metadata={"k": "v"}, max_output_tokens=9, temperature=0.5, top_p=0.5,
             service_tier="flex", user="u", text={"format": {"type": "json_object"}})
    raw = encode(r.render_finished(e, result, "j1", 7))
    assert raw == (
        b'{"id":"resp_j1","object":"response","created_at":7,"status":"completed","background":false,"error":null,'
        b'"incomplete_details":null,"instructions":"sys","max_output_tokens":9,"max_tool_calls":null,"model":"m",'
        b'"output":[{"type":"message","id":"msg_j1","status":"completed","role":"assistant","content":[{"type":'
        b'"output_text","text":"Hey","annotations":[]}]}],"parallel_tool_calls":false,"previous_response_id":null,'
        b'"reasoning":{"effort":null,"summary":null},"service_tier":"flex","store":true,"temperature":0.5,'
        b'"text":{"format":{"type":"json_object"}},"tool_choice":"none","tools":[],"top_logprobs":0,"top_p":0.5,'
        b'"truncation":"disabled","usage":{"input_tokens":3,"input_tokens_details":{"cached_tokens":0,'
        b'"cache_write_tokens":0},"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},'
        b'"total_tokens":5},"user":"u","metadata":{"k":"v"}}'
    )
    sdk = SdkResponse.model_validate_json(raw, strict=True)
    assert sdk.output_text == "Hey" and sdk.status == "completed"


def test_a_length_stop_is_incomplete_with_max_output_tokens():
    result = JobResult(choices=[Choice(text="ab", finish_reason="length")], usage=Usage(completion_tokens=2))
    resp = r.render_finished(echo(), result, "j1", 7)
    assert resp.status == "incomplete" and resp.incomplete_details == r.IncompleteDetails(reason="max_output_tokens")
    assert resp.output[0].status == "incomplete"
    SdkResponse.model_validate_json(encode(resp), strict=True)


def test_json_schema_format_is_echoed_as_sent():
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    resp = r.render_response(echo(text={"format": fmt}), "j1", 7, "queued")
    assert msgspec.to_builtins(resp.text) == {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "object"}, "strict": True}}
    assert SdkResponse.model_validate_json(encode(resp)).text.format.name == "x"


def record(status, **fields) -> JobRecord:
    g = req(model="m", service_tier="flex", temperature=0.3, max_output_tokens=5)
    return JobRecord(id="j1", model="m", status=status, request=g, queued_at=7999.0, **fields)


def test_a_record_renders_in_every_state():
    assert r.render_record(record("queued")).status == "queued"
    assert r.render_record(record("running")).status == "in_progress"
    assert r.render_record(record("running", cancel=True)).status == "cancelled"
    assert r.render_record(record("queued", cancel=True)).status == "cancelled"
    assert r.render_record(record("cancelled")).status == "cancelled"
    done = r.render_record(record("done", result=JobResult(choices=[Choice(text="x", finish_reason="stop")])))
    assert done.status == "completed" and done.output[0].content[0].text == "x" and done.created_at == 7
    # What the record keeps is echoed back: tier level, sampling, the token budget.
    assert (done.service_tier, done.temperature, done.max_output_tokens, done.model) == ("flex", 0.3, 5, "m")
    failed = r.render_record(record("failed", error=JobError(code="engine_dead", message="boom", status=503)))
    assert failed.status == "failed" and failed.error == r.ResponseError(code="server_error", message="boom")
    for resp in (done, failed, r.render_record(record("running"))):
        SdkResponse.model_validate_json(encode(resp), strict=True)


def test_render_result_is_the_dialect_hook_for_jobs_and_webhooks():
    g = req()
    out = dialect_render_result(g, JobResult(choices=[Choice(text="y")]), "j2", 1)
    assert isinstance(out, r.Response) and out.id == "resp_j2" and out.output[0].content[0].text == "y"
    assert dialect_error_body("openai_responses", JobNotFound("gone"))[0] == 404


def test_response_ids_map_to_jobs():
    assert r.job_id_of("resp_abc") == "abc" and r.job_id_of("abc") is None and r.response_id("abc") == "resp_abc"


def test_input_items_list_newest_first():
    g = req(instructions="sys", input=[{"role": "user", "content": "a"}])
    raw = encode(r.render_input_items(g, "j1"))
    assert raw == (b'{"object":"list","data":[{"id":"msg_j1_1","type":"message","role":"user","content":[{"type":'
                   b'"input_text","text":"a"}],"status":"completed"},{"id":"msg_j1_0","type":"message","role":"system",'
                   b'"content":[{"type":"input_text","text":"sys"}],"status":"completed"}],"first_id":"msg_j1_1",'
                   b'"last_id":"msg_j1_0","has_more":false}')
    ResponseItemList.model_validate_json(raw)


def test_deletion_object():
    assert encode(r.Deleted(id="resp_j1")) == b'{"id":"resp_j1","object":"response","deleted":true}'


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (JobNotFound("Response with id 'resp_x' not found."), 404, "invalid_request_error"),
    (Overloaded("full"), 429, "rate_limit_error"),
    (QueueUnavailable("down"), 503, "server_error"),
    (GenerationFailed("bad"), 500, "server_error"),
])
def test_errors_in_openai_shape(exc, status, kind):
    got_status, err = r.error_body(exc)
    assert got_status == status and msgspec.to_builtins(err) == {"error": {
        "message": exc.message, "type": kind, "param": None, "code": exc.code}}


# --- streaming --------------------------------------------------------------------------------

HEY = [Tokens(seq=1, deltas=[TokenDelta(text="He")]),
       Done(seq=2, deltas=[TokenDelta(text="y", finish_reason="stop")], usage=Usage(prompt_tokens=3,
                                                                                    completion_tokens=2))]
OBJ = (b'"id":"resp_j1","object":"response","created_at":7,"status":"%s","background":false,"error":null,'
       b'"incomplete_details":null,"instructions":null,"max_output_tokens":null,"max_tool_calls":null,"model":"m",'
       b'"output":%s,"parallel_tool_calls":false,"previous_response_id":null,"reasoning":{"effort":null,'
       b'"summary":null},"service_tier":"default","store":true,"temperature":1.0,"text":{"format":{"type":"text"}},'
       b'"tool_choice":"none","tools":[],"top_logprobs":0,"top_p":1.0,"truncation":"disabled","usage":%s,'
       b'"user":null,"metadata":{}')
MSG = (b'{"type":"message","id":"msg_j1","status":"completed","role":"assistant","content":[{"type":"output_text",'
       b'"text":"Hey","annotations":[]}]}')
USAGE = (b'{"input_tokens":3,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0},"output_tokens":2,'
         b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":5}')
PART = b'"item_id":"msg_j1","output_index":0,"content_index":0'


async def test_the_whole_stream_byte_for_byte():
    assert await frames(HEY) == [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{'
        + OBJ % (b"in_progress", b"[]", b"null") + b"}}\n\n",
        b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,"response":{'
        + OBJ % (b"in_progress", b"[]", b"null") + b"}}\n\n",
        b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2,'
        b'"output_index":0,"item":{"type":"message","id":"msg_j1","status":"in_progress","role":"assistant",'
        b'"content":[]}}\n\n',
        b'event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number":3,'
        + PART + b',"part":{"type":"output_text","text":"","annotations":[]}}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":4,'
        + PART + b',"delta":"He","logprobs":[]}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":5,'
        + PART + b',"delta":"y","logprobs":[]}\n\n',
        b'event: response.output_text.done\ndata: {"type":"response.output_text.done","sequence_number":6,'
        + PART + b',"text":"Hey","logprobs":[]}\n\n',
        b'event: response.content_part.done\ndata: {"type":"response.content_part.done","sequence_number":7,'
        + PART + b',"part":{"type":"output_text","text":"Hey","annotations":[]}}\n\n',
        b'event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":8,'
        b'"output_index":0,"item":' + MSG + b"}\n\n",
        b'event: response.completed\ndata: {"type":"response.completed","sequence_number":9,"response":{'
        + OBJ % (b"completed", b"[" + MSG + b"]", USAGE) + b"}}\n\n",
    ]


async def test_every_event_validates_as_the_sdks_and_numbers_follow_the_job_seq():
    out = await frames(HEY)
    for i, f in enumerate(out):
        name, data = parsed(f)
        event = STREAM_EVENT.validate_python(data, strict=True)
        assert event.type == name and event.sequence_number == i


async def test_each_job_event_is_one_delta_even_an_empty_one():
    events = [Tokens(seq=1, deltas=[]), Tokens(seq=2, deltas=[TokenDelta(text="a"), TokenDelta(text="b")]),
              Done(seq=3, deltas=[TokenDelta(text="", finish_reason="length")])]
    deltas = [parsed(f)[1] for f in await frames(events) if b"output_text.delta" in f[:40]]
    assert [(d["sequence_number"], d["delta"]) for d in deltas] == [(4, ""), (5, "ab"), (6, "")]
    assert r.delta_seq(1) == 4


async def test_a_length_stop_ends_incomplete():
    events = [Done(seq=1, deltas=[TokenDelta(text="ab", finish_reason="length")])]
    name, data = parsed((await frames(events))[-1])
    assert name == "response.incomplete" and data["sequence_number"] == 8
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["response"]["output"][0]["status"] == "incomplete"


async def test_a_job_error_is_response_failed_numbered_by_its_seq():
    out = await frames([Tokens(seq=1, deltas=[TokenDelta(text="a")]),
                        Error.of(GenerationFailed("engine broke"), 2)])
    name, data = parsed(out[-1])
    assert (name, data["sequence_number"], len(out)) == ("response.failed", 5, 6)
    assert data["response"]["status"] == "failed" and data["response"]["output"] == []
    assert data["response"]["error"] == {"code": "server_error", "message": "engine broke"}
    STREAM_EVENT.validate_python(data, strict=True)


async def test_a_cancelled_job_fails_the_stream_with_status_cancelled():
    name, data = parsed((await frames([Error(seq=1, code="cancelled", message="cancelled", status=499)]))[-1])
    assert name == "response.failed" and data["response"]["status"] == "cancelled"
    assert data["response"]["error"] is None


async def test_keepalives_are_comments_and_a_broken_relay_is_an_error_event():
    async def broken():
        yield Keepalive()
        yield Tokens(seq=1, deltas=[TokenDelta(text="a")])
        raise QueueUnavailable("lost the queue")

    out = await rendered(r.ResponseStream(echo(), "j1", 7), broken())
    assert out[4] == KEEPALIVE
    name, data = parsed(out[-1])
    assert name == "error" and data == {"type": "error", "sequence_number": 5, "code": "queue_unavailable",
                                        "message": "lost the queue", "param": None}


@pytest.mark.parametrize("after", [-1, 0, 2, 3, 4, 6, 8, 9, 20])
async def test_starting_after_sends_exactly_the_later_events(after):
    whole = await frames(HEY)
    assert await frames(HEY, starting_after=after) == whole[after + 1:]


async def test_a_background_stream_opens_queued():
    name, data = parsed((await frames(HEY, echo=echo(background=True)))[0])
    assert data["response"]["status"] == "queued" and data["response"]["background"] is True


# --- fuzzing: any body is a 4xx or a request the worker reads back exactly --------------------


def _translate(raw: bytes) -> GenerationRequest | None:
    """What ``POST /v1/responses`` does before queueing (decode_body, translate, admit's checks)."""
    try:
        decoded = json_input.decode(raw, json_input.decoder_for(r.ResponsesRequest))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None  # decode_body's 400
    try:
        g = r.to_generation_request(decoded, max_model_len=MAX_LEN)
        check_queueable(g)
    except ServiceError as exc:
        assert 400 <= exc.status < 500, exc.message
        return None
    assert decode_request(encode(g)) == g  # what the worker reads back is what was queued
    return g


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses_bodies)
def test_fuzzed_bodies_are_refused_or_queued_exactly(raw: bytes):
    _translate(raw)


def test_every_field_set_to_every_edge_value():
    base = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "max_output_tokens": 3}
    paths = [*r.ResponsesRequest.__struct_fields__, "text.format", "text.format.type", "text.format.schema",
             "text.format.name", "reasoning.effort", "input.0"]
    for path, value, raw in single_field_bodies(base, paths):
        try:
            _translate(raw)
        except AssertionError as exc:
            raise AssertionError(f"{path}={value!r:.40}: {exc}") from None
