"""OpenAI Responses: translation of every field, every refusal, and the exact bytes of the objects
and stream events (validated against the openai SDK's own types, strictly)."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList

from api.dialects import error_body as dialect_error_body
from api.dialects import openai_responses as r
from api.dialects import openai_responses_render as rr
from api.dialects import render_result as dialect_render_result
from api.dialects.tiers import priority_of_tier
from api.submit import check_queueable
from shared import json_input
from shared.chat_template import chat_token_ids
from shared.codec import decode_event, decode_request, encode
from shared.errors import GenerationFailed, InvalidRequest, JobNotFound, Overloaded, QueueUnavailable, ServiceError
from shared.events import Done, Error, TokenDelta, Tokens, ToolCallDelta
from shared.framing import KEEPALIVE, Keepalive
from shared.schemas import (
    ChatMessage,
    ChatOptions,
    Choice,
    GenerationRequest,
    JobError,
    JobRecord,
    JobResult,
    Reported,
    StructuredOutput,
    Tool,
    ToolCall,
    ToolUse,
    Usage,
)
from tests.support.dialect_bodies import responses_bodies
from tests.support.fuzzing import single_field_bodies
from tests.support.streams import frames as rendered

MAX_LEN = 1024
# A function tool, a namespace (with a function and a custom tool) and hosted tools: what Codex sends.
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
             {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
             {"type": "custom", "name": "patch"}]},
         {"type": "web_search"}, {"type": "mcp", "server_label": "docs", "server_url": "http://x"},
         {"type": "local_shell"}]
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
    # developer stays developer: the chat template renders it as vLLM's does (shared/chat_template.py)
    items = [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}]},
        {"role": "system", "content": "e"},
    ]
    g = req(input=items, instructions="be brief")
    assert g.messages == [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="a"),
                          ChatMessage(role="assistant", content="b"), ChatMessage(role="developer", content="c\nd"),
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
            parallel_tool_calls=True, reasoning={"effort": None, "summary": "auto"}, truncation="disabled",
            include=["reasoning.encrypted_content"], tools=[])
    plain = req()
    # Only what the answers repeat differs: kept with the job for a later read.
    assert g.output.reported == Reported(metadata={"a": "b"}, user="u", store=False, tool_choice="none",
                                         parallel_tool_calls=True, reasoning_summary="auto")
    assert msgspec.structs.replace(g, output=plain.output) == plain


def test_a_stored_job_reports_what_its_first_answer_did():
    fmt = {"type": "json_schema", "name": "ans", "schema": {"type": "object"}, "strict": True}
    fields = dict(model="m", instructions="be brief", metadata={"k": "v"}, user="u1", background=True,
                  text={"format": fmt}, max_output_tokens=9, service_tier="flex", tools=TOOLS,
                  tool_choice={"type": "function", "name": "lookup"}, parallel_tool_calls=False,
                  reasoning={"effort": "high", "generate_summary": "concise"})
    g = req(**fields)
    stored = decode_request(encode(g))  # as a worker and a later poll read it back
    assert r.echo_of_request(stored) == r.echo_of_body(body(**fields), "m")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True, "store": False}, "background"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file",
                                                                                    "file_id": "f"}]}]},
     "input[0].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": 3}]}]}, "tools[0].tools[0]"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "name": "patch"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input[0].output[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "image"}]}]}, "input[0].content[0].type"),
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


# --- tools, tool history, reasoning -------------------------------------------------------------


def test_function_tools_and_choices_map_onto_the_chats_tools():
    weather = Tool(name="get_weather", description="Weather", strict=True,
                   parameters={"type": "object", "properties": {"city": {"type": "string"}}})
    lookup = Tool(name="crm__lookup", parameters={"type": "object"})
    assert req(tools=TOOLS).tools == ToolUse(tools=[weather, lookup], choice="auto", parallel=True)
    assert req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tools == ToolUse(
        tools=[weather, lookup], choice="required", parallel=False)
    assert req(tools=TOOLS, tool_choice="none").tools.choice == "none"  # offered (as vLLM does), not called
    named = req(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}).tools
    assert (named.choice, named.function) == ("function", "get_weather")
    assert req(tools=[{"type": "function", "name": "f"}]).tools.tools == [Tool(name="f")]


def test_a_namespaces_functions_are_offered_under_flat_names():
    # The model sees <namespace>__<name> (vLLM's flat name); a choice may name the function alone
    # when one namespace has it, with its namespace, or by the flat name.
    for choice in ({"type": "function", "name": "lookup"}, {"type": "function", "name": "lookup", "namespace": "crm"},
                   {"type": "function", "name": "crm__lookup"}):
        assert req(tools=TOOLS, tool_choice=choice).tools.function == "crm__lookup"
    twice = [*TOOLS, {"type": "namespace", "name": "erp", "description": "", "tools": [
        {"type": "function", "name": "lookup"}]}]
    assert [t.name for t in req(tools=twice).tools.tools] == ["get_weather", "crm__lookup", "erp__lookup"]
    exc = refused(tools=twice, tool_choice={"type": "function", "name": "lookup"})
    assert exc.param == "tool_choice" and "ambiguous" in exc.message


def test_hosted_tools_are_left_out_and_never_fail_a_request():
    hosted = [t for t in TOOLS if t["type"] not in ("function", "namespace")]
    g = req(tools=hosted)
    assert g.tools is None and req(tools=hosted, tool_choice="auto").tools is None
    # ... but the response reports every tool as it was sent (a function in OpenAI's full form).
    e = r.echo_of_request(req(tools=TOOLS))
    assert e.tools[0] == {**TOOLS[0]} and e.tools[1:] == TOOLS[1:]
    assert r.echo_of_request(req(tools=[{"type": "function", "name": "f"}])).tools == [
        {"type": "function", "name": "f", "description": None, "parameters": None, "strict": None}]
    assert (e.tool_choice, e.parallel_tool_calls) == ("auto", True)
    assert (r.echo_of_request(req()).tool_choice, r.echo_of_request(req()).parallel_tool_calls) == ("none", False)


def test_function_calls_and_their_outputs_become_tool_turns():
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "need it"}],
         "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "lookup", "namespace": "crm", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "a"},
                                                                         {"type": "input_text", "text": "b"}]},
        {"role": "developer", "content": "be terse"},
    ]
    assert req(input=items).messages == [
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", content="Checking.", reasoning="need it", tool_calls=[
            ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}'),
            ToolCall(id="call_2", name="crm__lookup", arguments="{}")]),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
        ChatMessage(role="tool", content="a\nb", tool_call_id="call_2"),
        ChatMessage(role="developer", content="be terse"),
    ]


def test_reasoning_items_fill_an_assistant_turn_or_add_nothing():
    # Only encrypted (from another server): nothing to say; the call makes its own turn.
    only_encrypted = [{"type": "reasoning", "summary": [], "encrypted_content": "x"},
                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]
    assert req(input=only_encrypted).messages == [ChatMessage(role="assistant", tool_calls=[
        ToolCall(id="c", name="f", arguments="")])]
    # A summary stands in for missing content; Codex's "text" parts are read as reasoning text.
    summary = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]}]
    assert req(input=summary).messages == [ChatMessage(role="assistant", reasoning="short")]
    codex = [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "long"}]},
             {"role": "assistant", "content": "done"}, {"role": "assistant", "content": "again"}]
    assert req(input=codex).messages == [ChatMessage(role="assistant", content="done", reasoning="long"),
                                         ChatMessage(role="assistant", content="again")]


def test_reasoning_effort_reaches_the_chat_template_and_summaries_are_accepted():
    g = req(reasoning={"effort": "low", "summary": "detailed"}, include=["reasoning.encrypted_content"])
    assert g.chat.template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert req(reasoning={"effort": "none"}).chat.template_kwargs == {"reasoning_effort": "none",
                                                                       "enable_thinking": False}
    assert req(reasoning={"summary": "auto"}).chat.template_kwargs == {}
    assert r.echo_of_request(g).reasoning == rr.Reasoning(effort="low", summary="detailed")
    with pytest.raises(msgspec.ValidationError):
        body(reasoning={"effort": "maximal"})


def test_a_chain_carries_the_previous_calls_and_this_inputs_outputs():
    first = req(input="weather?", tools=TOOLS)
    calls = [ToolCall(id="call_j0_0", name="get_weather", arguments='{"city":"Paris"}')]
    history = r.history_of(first, JobResult(choices=[Choice(text="", reasoning="think", tool_calls=calls,
                                                            finish_reason="tool_calls")]))
    assert history == [ChatMessage(role="user", content="weather?"),
                       ChatMessage(role="assistant", reasoning="think", tool_calls=calls)]
    second = r.to_generation_request(body(input=[{"type": "function_call_output", "call_id": "call_j0_0",
                                                  "output": "sunny"}], previous_response_id="resp_j0", tools=TOOLS),
                                     max_model_len=MAX_LEN, history=history)
    assert second.messages == [*history, ChatMessage(role="tool", content="sunny", tool_call_id="call_j0_0")]


class Template:
    """A tokenizer as chat_token_ids uses it: what it was given, for a template text."""

    def __init__(self, text: str) -> None:
        self.chat_template, self.seen = text, None

    def apply_chat_template(self, messages, **kwargs):
        self.seen = messages
        return [1]


def test_developer_turns_render_as_vllms_do():
    chat = [ChatMessage(role="system", content="sys"), ChatMessage(role="user", content="u"),
            ChatMessage(role="developer", content="dev")]
    plain = Template("{% for m in messages %}{{ m.content }}{% endfor %}")
    chat_token_ids(plain, chat, ChatOptions())
    # A template that does not name the role gets system turns, merged at the start (vLLM's rule).
    assert plain.seen == [{"role": "system", "content": "sys\n\ndev"}, {"role": "user", "content": "u"}]
    knows = Template("{% if m.role == 'developer' %}")
    chat_token_ids(knows, chat, ChatOptions())
    assert [m["role"] for m in knows.seen] == ["system", "user", "developer"]
    late_system = [ChatMessage(role="user", content="u"), ChatMessage(role="system", content="s")]
    chat_token_ids(plain, late_system, ChatOptions())
    assert [m["role"] for m in plain.seen] == ["user", "system"]  # no developer: as it was


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
    assert resp.status == "incomplete" and resp.incomplete_details == rr.IncompleteDetails(reason="max_output_tokens")
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
    assert failed.status == "failed" and failed.error == rr.ResponseError(code="server_error", message="boom")
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
    assert raw == (b'{"object":"list","data":[{"type":"message","id":"msg_j1_1","role":"user","content":[{"type":'
                   b'"input_text","text":"a"}],"status":"completed"},{"type":"message","id":"msg_j1_0","role":"system",'
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


async def test_events_with_no_new_text_send_nothing_and_numbers_stay_consecutive():
    events = [Tokens(seq=1, deltas=[]), Tokens(seq=2, deltas=[TokenDelta(text="a"), TokenDelta(text="b")]),
              Tokens(seq=3, deltas=[TokenDelta(token_ids=[5])]),
              Done(seq=4, deltas=[TokenDelta(finish_reason="length")])]
    out = [parsed(f) for f in await frames(events)]
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    assert [(d["sequence_number"], d["delta"]) for name, d in out if name == "response.output_text.delta"] == [
        (4, "a"), (5, "b")]


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
    assert out[2] == KEEPALIVE
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


# --- tools and reasoning on the wire -----------------------------------------------------------

AGENT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
               {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
                   {"type": "function", "name": "lookup", "description": "find one"}]},
               {"type": "web_search"}]
# Reasoning, then text (in the same delta as more reasoning), then two calls, the second one a
# namespace's function; call pieces as the worker publishes them (the first names the call).
AGENT = [
    Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], reasoning="Think")]),
    Tokens(seq=2, deltas=[TokenDelta(token_ids=[2, 3], reasoning=" hard", text="Hi")]),
    Tokens(seq=3, deltas=[TokenDelta(token_ids=[4], tool_calls=[
        ToolCallDelta(index=0, id="call_j1_0", name="get_weather", arguments='{"city":')])]),
    Tokens(seq=4, deltas=[TokenDelta(token_ids=[5], tool_calls=[
        ToolCallDelta(index=0, arguments='"Paris"}'), ToolCallDelta(index=1, id="call_j1_1", name="crm__lookup")])]),
    Done(seq=5, deltas=[TokenDelta(token_ids=[6], tool_calls=[ToolCallDelta(index=1, arguments="{}")],
                                   finish_reason="tool_calls")], usage=Usage(prompt_tokens=3, completion_tokens=6)),
]
AGENT_RESULT = JobResult(choices=[Choice(text="Hi", reasoning="Think hard", finish_reason="tool_calls", tool_calls=[
    ToolCall(id="call_j1_0", name="get_weather", arguments='{"city":"Paris"}'),
    ToolCall(id="call_j1_1", name="crm__lookup", arguments="{}")])], usage=Usage(prompt_tokens=3, completion_tokens=6))
AGENT_OBJ = (
    b'"id":"resp_j1","object":"response","created_at":7,"status":"%s","background":false,"error":null,'
    b'"incomplete_details":null,"instructions":null,"max_output_tokens":null,"max_tool_calls":null,"model":"m",'
    b'"output":%s,"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":"low",'
    b'"summary":null},"service_tier":"default","store":true,"temperature":1.0,"text":{"format":{"type":"text"}},'
    b'"tool_choice":"auto","tools":[{"type":"function","name":"get_weather","description":null,"parameters":'
    b'{"type":"object"},"strict":null},{"type":"namespace","name":"crm","description":"CRM","tools":[{"type":'
    b'"function","name":"lookup","description":"find one"}]},{"type":"web_search"}],"top_logprobs":0,"top_p":1.0,'
    b'"truncation":"disabled","usage":%s,"user":null,"metadata":{}')
AGENT_USAGE = (b'{"input_tokens":3,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0},"output_tokens":6,'
               b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":9}')
RS = (b'{"type":"reasoning","id":"rs_j1","summary":[],"content":[{"type":"reasoning_text","text":"Think hard"}],'
      b'"status":"completed"}')
HI = (b'{"type":"message","id":"msg_j1","status":"completed","role":"assistant","content":[{"type":"output_text",'
      b'"text":"Hi","annotations":[]}]}')
FC0 = (b'{"type":"function_call","id":"fc_j1_0","call_id":"call_j1_0","name":"get_weather",'
       b'"arguments":"{\\"city\\":\\"Paris\\"}","status":"completed"}')
FC1 = (b'{"type":"function_call","id":"fc_j1_1","call_id":"call_j1_1","name":"lookup","namespace":"crm",'
       b'"arguments":"{}","status":"completed"}')
AGENT_OUTPUT = b"[" + b",".join([RS, HI, FC0, FC1]) + b"]"


def agent_echo(**fields) -> r.Echo:
    return r.echo_of_body(body(tools=AGENT_TOOLS, reasoning={"effort": "low"}, **fields), "m")


def test_the_finished_agent_response_exact_and_valid_for_the_sdk():
    raw = encode(r.render_finished(agent_echo(), AGENT_RESULT, "j1", 7))
    assert raw == b"{" + AGENT_OBJ % (b"completed", AGENT_OUTPUT, AGENT_USAGE) + b"}"
    sdk = SdkResponse.model_validate_json(raw, strict=True)
    reasoning, message, weather, lookup = sdk.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Think hard" and reasoning.summary == []
    assert sdk.output_text == "Hi" and message.id == "msg_j1"
    assert (weather.call_id, weather.name, weather.namespace, weather.arguments) == (
        "call_j1_0", "get_weather", None, '{"city":"Paris"}')
    assert (lookup.id, lookup.name, lookup.namespace) == ("fc_j1_1", "lookup", "crm")


def test_only_calls_mean_no_message_and_a_length_stop_leaves_the_last_item_incomplete():
    def output(**choice) -> list[tuple[str, str]]:
        resp = r.render_finished(agent_echo(), JobResult(choices=[Choice(**choice)]), "j1", 7)
        SdkResponse.model_validate_json(encode(resp), strict=True)
        return [(i["type"], i["status"]) for i in msgspec.to_builtins(resp)["output"]]

    calls = [ToolCall(id="call_j1_0", name="get_weather", arguments='{"ci')]
    assert output(tool_calls=calls, finish_reason="length") == [("function_call", "incomplete")]
    assert output(reasoning="hm", text="a", finish_reason="length") == [("reasoning", "completed"),
                                                                        ("message", "incomplete")]
    # It only thought: no empty message beside the reasoning. Nothing at all: one empty message.
    assert output(reasoning="hm", finish_reason="stop") == [("reasoning", "completed")]
    assert output(finish_reason="stop") == [("message", "completed")]


def ev(name: str, n: int, rest: bytes) -> bytes:
    return b"event: %s\ndata: {\"type\":\"%s\",\"sequence_number\":%d,%s}\n\n" % (name.encode(), name.encode(), n, rest)


async def test_the_agent_stream_byte_for_byte():
    opening = AGENT_OBJ % (b"in_progress", b"[]", b"null")
    rs_at, hi_at = b'"item_id":"rs_j1","output_index":0', b'"item_id":"msg_j1","output_index":1'
    fc0_at, fc1_at = b'"item_id":"fc_j1_0","output_index":2', b'"item_id":"fc_j1_1","output_index":3'
    assert await frames(AGENT, echo=agent_echo()) == [
        ev("response.created", 0, b'"response":{' + opening + b"}"),
        ev("response.in_progress", 1, b'"response":{' + opening + b"}"),
        ev("response.output_item.added", 2, b'"output_index":0,"item":{"type":"reasoning","id":"rs_j1","summary":[],'
           b'"content":[],"status":"in_progress"}'),
        ev("response.content_part.added", 3, rs_at + b',"content_index":0,"part":{"type":"reasoning_text","text":""}'),
        ev("response.reasoning_text.delta", 4, rs_at + b',"content_index":0,"delta":"Think"'),
        ev("response.reasoning_text.delta", 5, rs_at + b',"content_index":0,"delta":" hard"'),
        ev("response.reasoning_text.done", 6, rs_at + b',"content_index":0,"text":"Think hard"'),
        ev("response.content_part.done", 7, rs_at + b',"content_index":0,"part":{"type":"reasoning_text",'
           b'"text":"Think hard"}'),
        ev("response.output_item.done", 8, b'"output_index":0,"item":' + RS),
        ev("response.output_item.added", 9, b'"output_index":1,"item":{"type":"message","id":"msg_j1","status":'
           b'"in_progress","role":"assistant","content":[]}'),
        ev("response.content_part.added", 10, hi_at + b',"content_index":0,"part":{"type":"output_text","text":"",'
           b'"annotations":[]}'),
        ev("response.output_text.delta", 11, hi_at + b',"content_index":0,"delta":"Hi","logprobs":[]'),
        ev("response.output_text.done", 12, hi_at + b',"content_index":0,"text":"Hi","logprobs":[]'),
        ev("response.content_part.done", 13, hi_at + b',"content_index":0,"part":{"type":"output_text","text":"Hi",'
           b'"annotations":[]}'),
        ev("response.output_item.done", 14, b'"output_index":1,"item":' + HI),
        ev("response.output_item.added", 15, b'"output_index":2,"item":{"type":"function_call","id":"fc_j1_0",'
           b'"call_id":"call_j1_0","name":"get_weather","arguments":"","status":"in_progress"}'),
        ev("response.function_call_arguments.delta", 16, fc0_at + b',"delta":"{\\"city\\":"'),
        ev("response.function_call_arguments.delta", 17, fc0_at + b',"delta":"\\"Paris\\"}"'),
        ev("response.function_call_arguments.done", 18, fc0_at + b',"arguments":"{\\"city\\":\\"Paris\\"}"'),
        ev("response.output_item.done", 19, b'"output_index":2,"item":' + FC0),
        ev("response.output_item.added", 20, b'"output_index":3,"item":{"type":"function_call","id":"fc_j1_1",'
           b'"call_id":"call_j1_1","name":"lookup","namespace":"crm","arguments":"","status":"in_progress"}'),
        ev("response.function_call_arguments.delta", 21, fc1_at + b',"delta":"{}"'),
        ev("response.function_call_arguments.done", 22, fc1_at + b',"arguments":"{}"'),
        ev("response.output_item.done", 23, b'"output_index":3,"item":' + FC1),
        ev("response.completed", 24, b'"response":{' + AGENT_OBJ % (b"completed", AGENT_OUTPUT, AGENT_USAGE) + b"}"),
    ]


async def test_the_agent_stream_validates_and_ends_as_the_response_reads_back():
    out = [parsed(f) for f in await frames(AGENT, echo=agent_echo())]
    for i, (name, data) in enumerate(out):
        event = STREAM_EVENT.validate_python(data, strict=True)
        assert event.type == name and event.sequence_number == i
    later = encode(r.render_record(JobRecord(id="j1", model="m", status="done", request=req(
        tools=AGENT_TOOLS, reasoning={"effort": "low"}, max_output_tokens=None), queued_at=7000.0,
        result=AGENT_RESULT)))
    assert msgspec.json.decode(later)["output"] == out[-1][1]["response"]["output"]


async def test_the_stream_is_a_pure_function_of_the_events():
    assert await frames(AGENT, echo=agent_echo()) == await frames(AGENT, echo=agent_echo())
    # Re-rendered from a stored log (the event log is what a resume reads), the same bytes.
    stored = [decode_event(encode(e)) for e in AGENT]
    assert await frames(stored, echo=agent_echo()) == await frames(AGENT, echo=agent_echo())


@pytest.mark.parametrize("after", range(-1, 26))
async def test_a_resume_from_any_number_is_exactly_the_rest_of_the_agent_stream(after):
    whole = await frames(AGENT, echo=agent_echo())
    assert await frames(AGENT, echo=agent_echo(), starting_after=after) == whole[after + 1:]


async def test_a_length_stop_inside_a_call_streams_it_incomplete():
    events = [Tokens(seq=1, deltas=[TokenDelta(tool_calls=[ToolCallDelta(index=0, id="call_j1_0", name="f")])]),
              Done(seq=2, deltas=[TokenDelta(tool_calls=[ToolCallDelta(index=0, arguments='{"a')],
                                             finish_reason="length")])]
    out = [parsed(f) for f in await frames(events, echo=agent_echo())]
    assert [name for name, _ in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.incomplete"]
    assert out[5][1]["item"]["status"] == "incomplete" and out[5][1]["item"]["arguments"] == '{"a'
    assert out[-1][1]["response"]["output"] == [out[5][1]["item"]]


async def test_a_piece_of_a_finished_item_is_not_streamed_again_but_the_response_has_it():
    # No vLLM parser sends content after a call; if one did, the stream stays valid and whole.
    events = [Tokens(seq=1, deltas=[TokenDelta(text="A")]),
              Tokens(seq=2, deltas=[TokenDelta(tool_calls=[ToolCallDelta(index=0, id="call_j1_0", name="f")])]),
              Done(seq=3, deltas=[TokenDelta(text="B", finish_reason="tool_calls")])]
    out = [parsed(f) for f in await frames(events, echo=agent_echo())]
    assert [d["delta"] for name, d in out if name == "response.output_text.delta"] == ["A"]
    assert [i["type"] for i in out[-1][1]["response"]["output"]] == ["message", "function_call"]
    assert out[-1][1]["response"]["output"][0]["content"][0]["text"] == "AB"
    for _, data in out:
        STREAM_EVENT.validate_python(data, strict=True)


def sdk(raw: bytes, content_type: str) -> openai.OpenAI:
    """The openai SDK, answered with ``raw``: what it makes of exactly these bytes."""
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=raw, headers={"content-type": content_type})

    return openai.OpenAI(base_url="http://llmq.test/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def check_agent_output(output) -> None:
    reasoning, message, weather, lookup = output
    assert (reasoning.type, reasoning.id, reasoning.content[0].text) == ("reasoning", "rs_j1", "Think hard")
    assert (message.type, message.content[0].text) == ("message", "Hi")
    assert (weather.type, weather.call_id, weather.name, weather.arguments) == (
        "function_call", "call_j1_0", "get_weather", '{"city":"Paris"}')
    assert (lookup.call_id, lookup.name, lookup.namespace, lookup.arguments) == ("call_j1_1", "lookup", "crm", "{}")


async def test_the_sdk_accepts_the_exact_stream_bytes():
    raw = b"".join(await frames(AGENT, echo=agent_echo()))
    with sdk(raw, "text/event-stream").responses.stream(model="m", input="hi", tools=AGENT_TOOLS) as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen[-1] == "response.completed" and final.id == "resp_j1" and final.usage.total_tokens == 9
    check_agent_output(final.output)
    # What Codex reads: each call whole in its output_item.done.
    events = list(sdk(raw, "text/event-stream").responses.create(model="m", input="hi", stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    check_agent_output(done)
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 6


def test_the_sdk_accepts_the_exact_finished_bytes():
    raw = encode(r.render_finished(agent_echo(), AGENT_RESULT, "j1", 7))
    resp = sdk(raw, "application/json").responses.create(model="m", input="hi", tools=AGENT_TOOLS)
    check_agent_output(resp.output)
    assert resp.output_text == "Hi" and resp.tool_choice == "auto" and resp.parallel_tool_calls is True
    assert [t.type for t in resp.tools] == ["function", "namespace", "web_search"]


def test_input_items_list_tool_turns_as_items():
    items = [{"role": "user", "content": "weather?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "need it"}]},
             {"type": "function_call", "call_id": "call_1", "name": "lookup", "namespace": "crm", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "found"}]
    raw = encode(r.render_input_items(req(input=items, tools=AGENT_TOOLS), "j1"))
    assert raw == (
        b'{"object":"list","data":[{"type":"function_call_output","id":"fco_j1_2","call_id":"call_1","output":"found",'
        b'"status":"completed"},{"type":"function_call","id":"fc_j1_1_0","call_id":"call_1","name":"lookup",'
        b'"namespace":"crm","arguments":"{}","status":"completed"},{"type":"reasoning","id":"rs_j1_1","summary":[],'
        b'"content":[{"type":"reasoning_text","text":"need it"}],"status":"completed"},{"type":"message","id":'
        b'"msg_j1_0","role":"user","content":[{"type":"input_text","text":"weather?"}],"status":"completed"}],'
        b'"first_id":"fco_j1_2","last_id":"msg_j1_0","has_more":false}')
    listed = ResponseItemList.model_validate_json(raw, strict=True)
    assert [i.type for i in listed.data] == ["function_call_output", "function_call", "reasoning", "message"]


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
