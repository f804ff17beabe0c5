"""Triton generate extension (vLLM backend): translation, validation messages, rendering bytes."""

from __future__ import annotations

import json

import pytest

from api.dialects import triton as tr
from shared.codec import encode
from shared.errors import InvalidRequest, JobCancelled, ModelNotFound, QueueUnavailable, ServiceError
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import Keepalive
from shared.schemas import Choice, JobResult, PromptInfo, StructuredOutput, TopLogprob, Usage
from tests.support.streams import frames


def translate(body: dict):
    return tr.to_generation_request(tr.read_body(body), "tiny")


def wire(obj) -> dict:
    """What a client reads: the response Struct encoded, then parsed (key order kept)."""
    return json.loads(encode(obj))


def invalid(body: dict) -> str:
    with pytest.raises(InvalidRequest) as info:
        translate(body)
    status, payload = tr.error_body(info.value)
    assert status == 400 and set(wire(payload)) == {"error"}
    return payload.error


def test_parameters_are_vllm_sampling_params_and_inputs_are_found_in_parameters_too():
    # vLLM backend README: stream and exclude_input_in_output sit inside `parameters`
    req, opts = translate(
        {
            "text_input": "hi",
            "parameters": {"stream": False, "temperature": 0, "exclude_input_in_output": True, "max_tokens": 5},
        }
    )
    assert (req.prompt, req.model, req.dialect) == ("hi", "tiny", "triton")
    assert (req.sampling.temperature, req.sampling.max_tokens) == (0.0, 5)
    assert not opts.stream and not opts.prepend_input and not req.output.return_full_text


def test_top_level_keys_are_inputs_or_request_parameters():
    req, opts = translate(
        {
            "id": "r1",
            "text_input": ["hi"],
            "stream": [True],
            "top_k": "4",
            "seed": 3,
            "return_finish_reason": True,
            "return_num_output_tokens": True,
        }
    )
    assert opts.id == "r1" and opts.stream and not opts.prepend_input
    assert opts.return_finish_reason and opts.return_num_output_tokens and not opts.return_logprobs
    assert (req.prompt, req.sampling.top_k, req.sampling.seed) == ("hi", 4, 3)


def test_the_prompt_is_prepended_by_default_unless_streaming():
    assert translate({"text_input": "x"})[1].prepend_input
    assert translate({"text_input": "x"})[0].output.return_full_text
    assert not translate({"text_input": "x", "stream": True})[1].prepend_input
    assert invalid({"text_input": "x", "stream": True, "exclude_input_in_output": False}) == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    )


def test_string_values_are_converted_as_the_backend_does():
    s = translate(
        {"text_input": "x", "parameters": {"temperature": "0.5", "max_tokens": "7", "stop": "\n", "ignore_eos": "true"}}
    )[0].sampling
    assert (s.temperature, s.max_tokens, s.stop, s.ignore_eos) == (0.5, 7, ["\n"], True)


def test_sampling_parameters_input_replaces_request_parameters():
    req, _ = translate(
        {
            "text_input": "x",
            "parameters": {"temperature": 0.3},
            "sampling_parameters": json.dumps({"stop": ["a", "b"], "stop_token_ids": [2], "n": 2}),
        }
    )
    assert (req.sampling.stop, req.sampling.stop_token_ids, req.sampling.n) == (["a", "b"], [2], 2)
    assert req.sampling.temperature == 1.0
    assert "not valid JSON" in invalid({"text_input": "x", "sampling_parameters": "{nope"})


def test_structured_outputs_is_a_json_string_as_in_the_backend():
    so = translate({"text_input": "x", "parameters": {"structured_outputs": json.dumps({"choice": ["yes", "no"]})}})[
        0
    ].sampling.structured
    assert so == StructuredOutput(choice=["yes", "no"])
    schema = {"type": "object"}
    so = translate(
        {
            "text_input": "x",
            "sampling_parameters": json.dumps(
                {"structured_outputs": json.dumps({"json": json.dumps(schema), "disable_any_whitespace": True})}
            ),
        }
    )[0].sampling.structured
    assert so.json == schema
    assert invalid({"text_input": "x", "parameters": {"structured_outputs": '{"json": "true"}'}}) == (
        "Invalid structured_outputs: `json` must be a JSON Schema object"
    )
    assert invalid({"text_input": "x", "parameters": {"structured_outputs": "{}"}}).startswith(
        "Invalid structured_outputs: structured output needs exactly one of"
    )


def test_refusals_name_the_problem():
    assert invalid({"parameters": {"temperature": 0}}) == (
        "expected 1 inputs but got 0 inputs for model 'tiny': missing required input 'text_input'"
    )
    assert invalid({"text_input": "x", "id": 5}) == "Unable to parse 'id'"
    assert invalid({"text_input": "x", "parameters": {"stop": ["a"]}}) == (
        "parameter 'stop' has invalid type. It should be either 'int', 'bool', or 'string'."
    )
    assert invalid({"text_input": "x", "parameters": "no"}) == "Expected JSON object for keyword: 'parameters'"
    assert invalid({"text_input": "x", "parameters": {"lora_name": 5}}) == "`lora_name` must be a string"
    # A LoRA adapter is a model name: resolved at admission (an unknown one is the route's 404).
    assert translate({"text_input": "x", "parameters": {"lora_name": "a"}})[0].model == "a"
    assert translate({"text_input": "x"})[0].model == "tiny"
    assert "given twice" in invalid({"text_input": "x", "stream": True, "parameters": {"stream": True}})
    assert "not supported by llmq" in invalid({"text_input": "x", "image": ["aGk="]})
    assert "$.stream" in invalid({"text_input": "x", "stream": "yes"})
    assert "exactly one element" in invalid({"text_input": ["a", "b"]})
    detail = invalid({"text_input": "x", "parameters": {"best_of": 2}})
    assert detail.startswith("Unsupported sampling parameter(s): best_of. llmq accepts")
    assert "structured_outputs" in detail and "max_tokens" in detail
    assert invalid({"text_input": "x", "parameters": {"top_p": 0}}) == (
        "Invalid sampling parameter: Expected `float` > 0.0 - at `$.top_p`"
    )


def test_cumulative_logprob_needs_the_sampled_logprobs():
    req, opts = translate({"text_input": "x", "return_cumulative_logprob": True})
    assert req.sampling.logprobs == 0 and not opts.logprobs_asked
    req, opts = translate(
        {"text_input": "x", "return_num_input_tokens": True, "stream": True, "parameters": {"logprobs": 2}}
    )
    assert req.sampling.logprobs == 2 and opts.logprobs_asked and req.output.prompt_tokens


def test_response_keys_are_sorted_and_the_prompt_is_prepended():
    req, opts = translate(
        {
            "id": "7",
            "text_input": "Hi",
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_cumulative_logprob": True,
            "return_logprobs": True,
        }
    )
    result = JobResult(
        choices=[
            Choice(
                text=" there",
                token_ids=[5, 6],
                logprobs=[-0.1, -0.2],
                token_texts=[" the", "re"],
                finish_reason="length",
            )
        ],
        usage=Usage(prompt_tokens=3, completion_tokens=2),
    )
    body = wire(tr.render_response(req, result, opts))
    assert list(body) == sorted(body)
    assert body == {
        "cumulative_logprob": -0.30000001192092896,  # float32, widened
        "finish_reason": "length",
        "id": "7",
        "logprobs": "null",  # the backend's answer when `logprobs` was not a sampling parameter
        "model_name": "tiny",
        "model_version": "1",
        "num_input_tokens": 3,
        "num_output_tokens": 2,
        "text_output": "Hi there",
    }
    stored = encode(tr.render_result(req, result))
    assert stored == b'{"model_name":"tiny","model_version":"1","text_output":"Hi there"}'


def test_logprobs_output_is_a_json_string_sampled_token_first():
    req, opts = translate(
        {"text_input": "x", "return_logprobs": True, "exclude_input_in_output": True, "parameters": {"logprobs": 1}}
    )
    choice = Choice(
        text="ab",
        token_ids=[5, 6],
        logprobs=[-0.5, -1.0],
        token_texts=["a", "b"],
        top_logprobs=[[TopLogprob(5, "a", -0.5)], [TopLogprob(7, "c", -0.25)]],
    )
    body = tr.render_response(req, JobResult(choices=[choice]), opts)
    assert body.logprobs == (
        '[{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}, '
        '{"6": {"logprob": -1.0, "rank": null, "decoded_token": "b"}, '
        '"7": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}}]'
    )


def test_n_greater_than_one_gives_arrays():
    req, opts = translate(
        {"text_input": "x", "exclude_input_in_output": True, "return_finish_reason": True, "parameters": {"n": 2}}
    )
    result = JobResult(
        choices=[Choice(index=0, text="a", finish_reason="stop"), Choice(index=1, text="b", finish_reason="length")]
    )
    body = tr.render_response(req, result, opts)
    assert encode(body) == (
        b'{"finish_reason":["stop","length"],"model_name":"tiny","model_version":"1","text_output":["a","b"]}'
    )


async def _stream(req, opts, events) -> bytes:
    return b"".join(await frames(tr.TritonStream(req, opts=opts), events))


async def test_stream_is_data_space_json_deltas_without_terminator():
    req, opts = translate(
        {"id": "s", "text_input": "p", "stream": True, "return_finish_reason": True, "return_num_input_tokens": True}
    )
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")], prompt=PromptInfo(token_ids=[8, 9])),
        Keepalive(),
        Tokens(seq=2, deltas=[TokenDelta(token_ids=[2], text="")]),
        Done(
            seq=3,
            deltas=[TokenDelta(token_ids=[3], text="bc", finish_reason="stop")],
            usage=Usage(prompt_tokens=2, completion_tokens=3),
        ),
    ]
    head = b'data: {"finish_reason":"%s","id":"s","model_name":"tiny","model_version":"1","num_input_tokens":2,'
    assert await _stream(req, opts, events) == (
        head % b"None"
        + b'"text_output":"a"}\n\n'
        + head % b"None"
        + b'"text_output":""}\n\n'
        + head % b"stop"
        + b'"text_output":"bc"}\n\n'
    )


async def test_stream_error_after_the_first_event_is_an_in_band_error_event():
    req, opts = translate({"text_input": "p", "stream": True})
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
        Error(seq=2, code="generation_failed", message="engine died", status=500),
    ]
    assert await _stream(req, opts, events) == (
        b'data: {"model_name":"tiny","model_version":"1","text_output":"a"}\n\ndata: {"error":"engine died"}\n\n'
    )


async def test_stream_n2_sends_every_choice_each_step():
    req, opts = translate(
        {
            "text_input": "p",
            "stream": True,
            "return_finish_reason": True,
            "return_num_output_tokens": True,
            "parameters": {"n": 2},
        }
    )
    events = [
        Tokens(seq=1, deltas=[TokenDelta(index=1, token_ids=[1], text="x", finish_reason="stop")]),
        Done(seq=2, deltas=[TokenDelta(index=0, token_ids=[2, 3], text="yz", finish_reason="length")]),
    ]
    frames = [json.loads(f.removeprefix(b"data: ")) for f in (await _stream(req, opts, events)).split(b"\n\n")[:-1]]
    assert [f["text_output"] for f in frames] == [["", "x"], ["yz", ""]]
    assert [f["finish_reason"] for f in frames] == [["None", "stop"], ["length", "stop"]]
    assert [f["num_output_tokens"] for f in frames] == [[0, 1], [2, 0]]


def errors(exc: ServiceError) -> tuple[int, dict]:
    status, body = tr.error_body(exc)
    return status, wire(body)


def test_response_fields_are_in_tritons_sorted_order():
    fields = list(tr.GenerateResponse.__struct_fields__)
    assert fields == sorted(fields)


def test_error_statuses_follow_tritons_codes():
    cancelled = JobCancelled("Request was cancelled")
    teapot = ServiceError("odd")
    teapot.status = 418
    assert errors(InvalidRequest("bad")) == (400, {"error": "bad"})
    assert errors(ModelNotFound("gone")) == (404, {"error": "gone"})
    assert errors(QueueUnavailable("later")) == (503, {"error": "later"})
    assert errors(cancelled) == (400, {"error": "Request was cancelled"})
    assert errors(ServiceError("boom")) == (500, {"error": "boom"})
    assert tr.error_body(teapot)[0] == 400


def test_model_metadata_lists_the_backends_tensors():
    meta = tr.ModelMetadataResponse(name="tiny", versions=["1"], platform="vllm", inputs=tr.METADATA_INPUTS[:1],
                                    outputs=tr.METADATA_OUTPUTS[-1:])
    assert encode(meta) == (
        b'{"name":"tiny","versions":["1"],"platform":"vllm",'
        b'"inputs":[{"name":"text_input","datatype":"BYTES","shape":[1]}],'
        b'"outputs":[{"name":"num_output_tokens","datatype":"UINT32","shape":[-1]}]}'
    )
    assert [t.name for t in tr.METADATA_INPUTS] == ["text_input", "stream", "sampling_parameters",
                                                    "exclude_input_in_output", *tr.RETURN_FLAGS]
