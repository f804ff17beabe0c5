"""Anthropic's Message Batches, the pure part (api/dialects/anthropic_batches.py): the
message_batch object in each state and the results lines, byte for byte, and what the anthropic
SDK's own types make of them; the create body's validation and each request's translation."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from hypothesis import HealthCheck, given, settings

from api.dialects import anthropic_batches as ab
from api.dialects import anthropic_messages as am
from api.dialects.anthropic_render import signature
from shared import json_input
from shared.batches import MESSAGES, Answered, BatchObject, Failed, NotRun, Refused, RequestCounts
from shared.codec import encode
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import Choice, JobError, JobResult, ToolCall, Usage
from tests.support.dialect_bodies import message_batch_bodies

CREATED = 1_700_000_000  # 2023-11-14T22:13:20Z


def _batch(status: str, **fields) -> BatchObject:
    return BatchObject(id="msgbatch_1", endpoint=MESSAGES, input_file_id="", completion_window="24h", status=status,
                       created_at=CREATED, in_progress_at=CREATED, expires_at=CREATED + 24 * 3600, **fields)


def _object(status: str, counts: str, ended_at: str = "null", cancel: str = "null", url: str = "null") -> bytes:
    return (f'{{"id":"msgbatch_1","type":"message_batch","processing_status":"{status}","request_counts":{counts},'
            f'"ended_at":{ended_at},"created_at":"2023-11-14T22:13:20Z","expires_at":"2023-11-15T22:13:20Z",'
            f'"archived_at":null,"cancel_initiated_at":{cancel},"results_url":{url}}}').encode()


PROCESSING_4 = '{"processing":4,"succeeded":0,"errored":0,"canceled":0,"expired":0}'
URL = '"/v1/messages/batches/msgbatch_1/results"'


@pytest.mark.parametrize(("batch", "errors", "wire"), [
    # Every request counts as processing until the whole batch ended (whatever already finished).
    (_batch("in_progress", request_counts=RequestCounts(total=4, completed=1, failed=1)), None,
     _object("in_progress", PROCESSING_4)),
    # Writing the results is still processing: no results_url until they are there.
    (_batch("finalizing", finalizing_at=CREATED + 9, request_counts=RequestCounts(total=4, completed=4)), None,
     _object("in_progress", PROCESSING_4)),
    (_batch("cancelling", cancelling_at=CREATED + 5, request_counts=RequestCounts(total=4, completed=1)), None,
     _object("canceling", PROCESSING_4, cancel='"2023-11-14T22:13:25Z"')),
    (_batch("completed", completed_at=CREATED + 9, request_counts=RequestCounts(total=4, completed=3, failed=1)),
     Counter(errored=1),
     _object("ended", '{"processing":0,"succeeded":3,"errored":1,"canceled":0,"expired":0}',
             ended_at='"2023-11-14T22:13:29Z"', url=URL)),
    (_batch("cancelled", cancelling_at=CREATED + 5, cancelled_at=CREATED + 7,
            request_counts=RequestCounts(total=4, completed=1, failed=3)), Counter(errored=1, canceled=2),
     _object("ended", '{"processing":0,"succeeded":1,"errored":1,"canceled":2,"expired":0}',
             ended_at='"2023-11-14T22:13:27Z"', cancel='"2023-11-14T22:13:25Z"', url=URL)),
    (_batch("expired", cancelling_at=CREATED + 86400, expired_at=CREATED + 86401,
            request_counts=RequestCounts(total=4, completed=0, failed=4)), Counter(expired=3, canceled=1),
     _object("ended", '{"processing":0,"succeeded":0,"errored":0,"canceled":1,"expired":3}',
             ended_at='"2023-11-15T22:13:21Z"', url=URL)),  # no client asked for a cancel
])
def test_the_message_batch_object_in_each_state(batch, errors, wire):
    assert encode(ab.render_batch(batch, errors)) == wire
    parsed = MessageBatch.model_validate_json(wire)  # what the SDK builds from it
    counts = parsed.request_counts
    assert counts.processing + counts.succeeded + counts.errored + counts.canceled + counts.expired == 4
    assert (parsed.results_url is not None) == (parsed.processing_status == "ended") == (parsed.ended_at is not None)


def _request(params: bytes, custom_id: str = "a") -> ab.BatchRequest:
    return ab.BatchRequest(custom_id=custom_id, params=msgspec.Raw(params))


GOOD = b'{"model":"tiny","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}'
RESULT = JobResult(choices=[Choice(text="hé", token_ids=[1], finish_reason="length")],
                   usage=Usage(prompt_tokens=2, completion_tokens=1))
USAGE = ('"usage":{"input_tokens":2,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,'
         '"cache_creation":null,"output_tokens":1,"output_tokens_details":null,"server_tool_use":null,'
         '"service_tier":"standard","inference_geo":null}')


@pytest.mark.parametrize(("outcome", "wire"), [
    (Answered(custom_id="a", request_id="j1", created=CREATED, requests=[ab.translate(_request(GOOD))],
              results=[RESULT]),
     '{"custom_id":"a","result":{"type":"succeeded","message":{"id":"msg_j1","type":"message","role":"assistant",'
     '"content":[{"type":"text","text":"hé"}],"model":"tiny","stop_reason":"max_tokens","stop_sequence":null,'
     f'{USAGE}}}}}}}'),
    (Answered(custom_id="t", request_id="j2", created=CREATED, requests=[ab.translate(_request(GOOD))],
              results=[JobResult(choices=[Choice(reasoning="r", finish_reason="tool_calls", tool_calls=[
                  ToolCall(id="call_j2_0", name="f", arguments='{"a":1}')])],
                  usage=Usage(prompt_tokens=2, completion_tokens=1))]),
     '{"custom_id":"t","result":{"type":"succeeded","message":{"id":"msg_j2","type":"message","role":"assistant",'
     '"content":[{"type":"thinking","thinking":"r","signature":"' + signature("j2", 0) + '"},'
     '{"type":"tool_use","id":"toolu_j2_0","name":"f","input":{"a":1}}],"model":"tiny","stop_reason":"tool_use",'
     f'"stop_sequence":null,{USAGE}}}}}}}'),
    (Failed(custom_id="c", request_id="j4", error=JobError(code="deadline_exceeded", message="too late", status=504)),
     '{"custom_id":"c","result":{"type":"errored","error":{"type":"error","error":{"type":"timeout_error",'
     '"message":"too late"}}}}'),
    (Refused(custom_id="d", request_id="msgbatch_1_3", error=ab.refusal(InvalidRequest("max_tokens: bad"))),
     '{"custom_id":"d","result":{"type":"errored","error":{"type":"error","error":{"type":"invalid_request_error",'
     '"message":"max_tokens: bad"}}}}'),
    (NotRun(custom_id="e", request_id="msgbatch_1_4", code="batch_cancelled", message="cancelled"),
     '{"custom_id":"e","result":{"type":"canceled"}}'),
    (NotRun(custom_id="f", request_id="msgbatch_1_5", code="batch_expired", message="expired"),
     '{"custom_id":"f","result":{"type":"expired"}}'),
    (NotRun(custom_id="g", request_id="j7", code="job_lost", message="The request's job record expired."),
     '{"custom_id":"g","result":{"type":"errored","error":{"type":"error","error":{"type":"api_error",'
     '"message":"The request\'s job record expired."}}}}'),
])
def test_each_outcome_is_one_results_line_the_sdk_parses(outcome, wire):
    line = encode(ab.result_line(outcome))
    assert line == wire.encode()
    parsed = MessageBatchIndividualResponse.model_validate_json(line)
    assert parsed.custom_id == outcome.custom_id and parsed.result.type == msgspec.json.decode(line)["result"]["type"]


def test_tally_counts_results_lines_by_type():
    lines = b"".join(encode(ab.result_line(NotRun(custom_id=c, request_id="r", code=code, message="m"))) + b"\n"
                     for c, code in (("a", "batch_cancelled"), ("b", "batch_expired"), ("c", "batch_cancelled"),
                                     ("d", "job_lost")))
    assert ab.tally(lines) == Counter(canceled=2, expired=1, errored=1)
    assert ab.tally(b"") == Counter()


_create = msgspec.json.Decoder(ab.CreateBatch)


@pytest.mark.parametrize("body", [
    b"{}",  # no requests
    b'{"requests":[]}',
    b'{"requests":[{"custom_id":"a"}]}',  # no params
    b'{"requests":[{"custom_id":"has space","params":{}}]}',  # custom_id: [a-zA-Z0-9_-]{1,64}
    b'{"requests":[{"custom_id":"","params":{}}]}',
    b'{"requests":[{"custom_id":"' + b"x" * 65 + b'","params":{}}]}',
])
def test_a_malformed_create_body_refuses_the_whole_batch(body):
    with pytest.raises(msgspec.ValidationError):  # decode_body makes it a 400 invalid_request_error
        _create.decode(body)


def test_a_repeated_custom_id_refuses_the_whole_batch():
    body = _create.decode(b'{"requests":[{"custom_id":"a","params":{}},{"custom_id":"b","params":{}},'
                          b'{"custom_id":"a","params":{}}]}')
    with pytest.raises(InvalidRequest, match=r"requests\.2\.custom_id: 'a' is used more than once"):
        ab.check(body)
    ab.check(_create.decode(b'{"requests":[{"custom_id":"a","params":1},{"custom_id":"A","params":1}]}'))


def test_each_request_translates_as_post_v1_messages_would():
    req = ab.translate(_request(GOOD))
    assert (req.dialect, req.model, req.sampling.max_tokens) == ("anthropic_messages", "tiny", 3)
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]


TOOLS = (b'{"model":"tiny","max_tokens":3,"tools":[{"name":"f","input_schema":{"type":"object"}}],'
         b'"tool_choice":{"type":"any","disable_parallel_tool_use":true},"thinking":{"type":"adaptive"},'
         b'"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"thinking",'
         b'"thinking":"t","signature":"s"},{"type":"tool_use","id":"toolu_1","name":"f","input":{"a":1}}]},'
         b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"2"}]}]}')


def test_a_request_with_tools_translates_as_post_v1_messages_would():
    """A line with tools, tool history and thinking is the job its synchronous request would queue."""
    req = ab.translate(_request(TOOLS))
    assert req == am.to_generation_request(msgspec.json.decode(TOOLS, type=am.MessagesRequest))
    assert (req.tools.choice, req.tools.parallel, [t.name for t in req.tools.tools]) == ("required", False, ["f"])
    assert [m.role for m in req.messages] == ["user", "assistant", "tool"]
    assert req.messages[1].tool_calls[0].arguments == '{"a":1}' and req.messages[2].tool_call_id == "toolu_1"


@pytest.mark.parametrize(("params", "message"), [
    (b'"not an object"', "params: Expected `object`"),
    (b'{"model":"tiny","messages":[]}', "params: Object missing required field `max_tokens`"),
    (b'{"model":"tiny","max_tokens":0,"messages":[]}', "params: Expected `int` >= 1 - at `$.max_tokens`"),
    (b'{"model":"tiny","max_tokens":3,"stream":true,"messages":[{"role":"user","content":"x"}]}',
     "params.stream: streaming is not supported in a batch"),
    (b'{"model":"tiny","max_tokens":3,"tools":[{"name":"f"}],"messages":[{"role":"user","content":"x"}]}',
     "tools.0.input_schema: Field required"),
])
def test_a_request_the_endpoint_would_refuse_is_one_errored_line(params, message):
    with pytest.raises(ServiceError) as caught:
        ab.translate(_request(params))
    assert caught.value.message.startswith(message)
    refused = ab.refusal(caught.value)
    assert refused.status == 400
    assert msgspec.json.decode(refused.body)["error"]["type"] == "invalid_request_error"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(message_batch_bodies)
def test_any_create_body_is_a_batch_of_translated_or_errored_lines_or_a_4xx(raw: bytes):
    try:
        body = json_input.decode(raw, json_input.decoder_for(ab.CreateBatch))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return  # decode_body: a 400 for the whole call
    try:
        ab.check(body)
    except InvalidRequest:
        return
    for request in body.requests:
        try:
            req = ab.translate(request)
        except ServiceError as exc:  # an errored line: Anthropic's 4xx body
            refused = ab.refusal(exc)
            assert 400 <= refused.status < 500
            assert msgspec.json.decode(refused.body)["type"] == "error"
        else:
            assert req.dialect == "anthropic_messages"
