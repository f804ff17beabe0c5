"""Dialect translation and rendering, without a server."""

from __future__ import annotations

import msgspec
import pytest

from api.dialects import lmi
from api.dialects import openai_completions as oc
from api.dialects.lmi_render import finish_reason
from shared.codec import encode
from shared.errors import InvalidRequest, error_from_code
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import SSE_DONE, Keepalive, sse
from shared.schemas import Choice, JobResult, PromptInfo, TopLogprob, Usage
from tests.support.streams import frames


def lmi_req(body: dict):
    return lmi.to_generation_request(msgspec.convert(body, lmi.LmiRequest))


def test_lmi_defaults_are_greedy_with_30_new_tokens():
    req = lmi_req({"inputs": "hi"})
    assert req.sampling.temperature == 0.0 and req.sampling.max_tokens == 30
    assert req.sampling.logprobs == 0  # every LMI token line carries a log_prob
    assert req.dialect == "lmi" and req.prompt == "hi"


def test_lmi_infers_sampling_from_parameters_and_do_sample_false_wins():
    assert lmi_req({"inputs": "x", "parameters": {"temperature": 0.7}}).sampling.temperature == 0.7
    assert lmi_req({"inputs": "x", "parameters": {"do_sample": True}}).sampling.temperature == 1.0
    greedy = lmi_req({"inputs": "x", "parameters": {"do_sample": False, "temperature": 0.7, "top_k": 5}})
    assert greedy.sampling.temperature == 0.0 and greedy.sampling.top_k == 0


def test_lmi_maps_stop_sequences_and_vllm_extras():
    req = lmi_req({"inputs": "x", "parameters": {"stop_sequences": ["\n"], "max_new_tokens": 7,
                                                "ignore_eos_token": True, "repetition_penalty": 1.2,
                                                "details": True, "return_full_text": True}})
    s = req.sampling
    assert (s.stop, s.max_tokens, s.ignore_eos, s.repetition_penalty) == (["\n"], 7, True, 1.2)
    assert req.output.details and req.output.return_full_text


@pytest.mark.parametrize("body", [
    {"inputs": "x", "parameters": {"n": 2}},  # several sequences need sampling
    {"inputs": "x", "stream": True, "parameters": {"n": 2, "do_sample": True}},
    {"inputs": "x", "stream": True, "parameters": {"num_beams": 2}},
    {"inputs": "x", "stream": True, "parameters": {"decoder_input_details": True}},
    {"inputs": [], "parameters": {}},
    {"inputs": ["a", "b"], "parameters": {"num_beams": 2}},
])
def test_lmi_rejects_what_lmi_rejects(body):
    with pytest.raises(InvalidRequest):
        lmi.to_generation_requests(msgspec.convert(body, lmi.LmiRequest))


def test_lmi_best_of_beams_prefill_and_top_tokens_map_onto_the_engine():
    best = lmi_req({"inputs": "x", "parameters": {"best_of": 3, "n": 1, "temperature": 0.8}})
    assert best.sampling.n == 3
    beams = lmi_req({"inputs": "x", "parameters": {"num_beams": 4}})
    assert beams.sampling.beam_width == 4 and beams.sampling.n == 1
    prefill = lmi_req({"inputs": "x", "parameters": {"decoder_input_details": True, "top_n_tokens": 2}})
    assert prefill.output.prompt_tokens and prefill.sampling.prompt_logprobs == 0
    assert prefill.sampling.logprobs == 2
    batch = lmi.to_generation_requests(msgspec.convert({"inputs": ["a", "b"]}, lmi.LmiRequest))
    assert [r.prompt for r in batch] == ["a", "b"] and {r.dialect for r in batch} == {"lmi_batch"}


def test_lmi_several_sequences_put_the_most_likely_first_and_the_rest_in_best_of_sequences():
    req = lmi_req({"inputs": "p", "parameters": {"best_of": 2, "temperature": 0.8}})
    unlikely = Choice(index=0, text="a", token_ids=[5], token_texts=["a"], logprobs=[-3.0], finish_reason="length")
    likely = Choice(index=1, text="b", token_ids=[2], token_texts=[""], logprobs=[-0.1], finish_reason="stop")
    body = msgspec.to_builtins(lmi.render_result(req, JobResult(choices=[unlikely, likely])))
    assert body["generated_text"] == "b" and body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["tokens"] == [{"id": 2, "text": "", "log_prob": -0.1, "special_token": True}]
    (other,) = body["details"]["best_of_sequences"]
    assert other == {"generated_text": "a", "finish_reason": "length", "generated_tokens": 1,
                     "tokens": [{"id": 5, "text": "a", "log_prob": -3.0}]}


def test_lmi_tgi_compat_is_an_array_with_details_and_tgi_token_names():
    req = lmi.to_generation_request(msgspec.convert({"inputs": "p"}, lmi.LmiRequest), tgi_compat=True)
    choice = Choice(text="a", token_ids=[5], token_texts=["a"], logprobs=[-1.0], finish_reason="length")
    assert encode(lmi.render_result(req, JobResult(choices=[choice]))) == (
        b'[{"generated_text":"a","details":{"finish_reason":"length","generated_tokens":1,"inputs":"p",'
        b'"tokens":[{"id":5,"text":"a","logprob":-1.0,"special":false}],"seed":null}}]'
    )


def test_lmi_decoder_input_details_gives_prefill():
    req = lmi_req({"inputs": "p", "parameters": {"decoder_input_details": True, "details": True}})
    prompt = PromptInfo(token_ids=[1, 9], token_texts=["<s>", "p"], logprobs=[None, -2.0])
    choice = Choice(text="a", token_ids=[5], token_texts=["a"], logprobs=[-1.0], finish_reason="length")
    body = msgspec.to_builtins(lmi.render_result(req, JobResult(choices=[choice], prompt=prompt)))
    assert body["details"]["prefill"] == [{"id": 1, "text": "<s>", "log_prob": None},
                                          {"id": 9, "text": "p", "log_prob": -2.0}]


async def test_lmi_stream_error_after_first_token_ends_with_the_documented_error_line():
    req = lmi_req({"inputs": "x"})
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", token_texts=["a"], logprobs=[-1.0])]),
              Keepalive(), Error(seq=2, code="generation_failed", message="engine died", status=500)]
    lines = [msgspec.json.decode(x) for x in await frames(lmi.LmiStream(req, sse_format=False), events)]
    assert lines[0] == {"token": {"id": 1, "text": "a", "log_prob": -1.0}}
    assert lines[1]["details"] == {"finish_reason": "error", "generated_tokens": None, "inputs": None}
    assert lines[1]["token"]["id"] == -1 and lines[1]["generated_text"] == ""


async def test_lmi_sse_frames_are_data_space_json():
    req = lmi_req({"inputs": "x"})
    done = Done(seq=1, deltas=[TokenDelta(token_ids=[9], text="z", token_texts=["z"], logprobs=[-0.5],
                                          finish_reason="stop")], usage=Usage(completion_tokens=1))
    assert await frames(lmi.LmiStream(req, sse_format=True), [done]) == [
        b'data: {"token":{"id":9,"text":"z","log_prob":-0.5,"special_token":true},"generated_text":"z"}\n\n'
    ]


def test_lmi_finish_reasons_use_lmi_vocabulary():
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", None) == "eos_token"
    assert finish_reason("stop", "\n") == "stop_sequence"


async def test_lmi_tgi_compat_stream_lines_carry_nulls_until_the_last():
    req = lmi.to_generation_request(msgspec.convert({"inputs": "p", "parameters": {"top_n_tokens": 1, "seed": 4}},
                                                    lmi.LmiRequest), tgi_compat=True)
    top = [[TopLogprob(7, "q", -0.25)]]
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", logprobs=[-1.0], top_logprobs=top)]),
              Done(seq=2, deltas=[TokenDelta(token_ids=[2], text="b", logprobs=[-0.5], top_logprobs=top,
                                             finish_reason="length")], usage=Usage(prompt_tokens=3))]
    assert await frames(lmi.LmiStream(req, sse_format=True), events) == [
        b'data: {"index":0,"token":{"id":1,"text":"a","logprob":-1.0,"special":false},"generated_text":null,'
        b'"details":null,"top_tokens":[{"id":7,"text":"q","logprob":-0.25,"special":false}]}\n\n',
        b'data: {"index":0,"token":{"id":2,"text":"b","logprob":-0.5,"special":false},"generated_text":"ab",'
        b'"details":{"finish_reason":"length","generated_tokens":2,"inputs":"p","input_length":3,"seed":4},'
        b'"top_tokens":[{"id":7,"text":"q","logprob":-0.25,"special":false}]}\n\n',
    ]


async def test_lmi_stream_error_line_is_byte_exact():
    req = lmi_req({"inputs": "x", "parameters": {"top_n_tokens": 1}})
    top = [[TopLogprob(7, "q", -0.25)]]
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", logprobs=[-1.0], top_logprobs=top)]),
              Error(seq=2, code="generation_failed", message="engine died", status=500)]
    assert await frames(lmi.LmiStream(req, sse_format=False), events) == [
        b'{"token":{"id":1,"text":"a","log_prob":-1.0},"top_tokens":[{"id":7,"text":"q","log_prob":-0.25}]}\n',
        b'{"token":{"id":-1,"text":"","log_prob":-1,"special_token":true},"generated_text":"",'
        b'"details":{"finish_reason":"error","generated_tokens":null,"inputs":null},"error":"engine died"}\n',
    ]


async def test_lmi_dynamic_batch_stream_and_result():
    from api.dialects.lmi_render import BatchStream, render_batch_result

    events = [Tokens(seq=1, deltas=[TokenDelta(index=1, text="b"), TokenDelta(index=0, text="a")]), Keepalive(),
              Tokens(seq=2, deltas=[TokenDelta(index=0)]),
              Error(seq=3, code="generation_failed", message="died", status=500)]
    assert await frames(BatchStream(2), events) == [
        b'{"outputs":["a","b"]}\n', b'{"code":424,"message":"invoke handler failure","error":"died"}\n'
    ]
    results = [JobResult(choices=[Choice(text="x")]), JobResult()]
    assert encode(render_batch_result(results)) == b'[{"generated_text":"x"},{"generated_text":""}]'


@pytest.mark.parametrize(("dialect", "error", "status", "body"), [
    ("lmi", InvalidRequest("bad"), 424, b'{"error":"bad","code":424}'),
    ("lmi", error_from_code("generation_failed", "died", 500), 500,
     b'{"generated_text":"","error":"died","code":500,'
     b'"details":{"finish_reason":"error","generated_tokens":null,"inputs":null,"tokens":null}}'),
    ("lmi_tgi", error_from_code("model_not_found", "nope", 404), 404,
     b'{"code":404,"type":"model_not_found","message":"nope"}'),
    ("lmi_batch", InvalidRequest("bad"), 424, b'{"code":424,"message":"invoke handler failure","error":"bad"}'),
    ("lmi_batch", error_from_code("deadline_exceeded", "late", 504), 504,
     b'{"code":504,"type":"deadline_exceeded","message":"late"}'),
    ("jobs", InvalidRequest("bad", param="x"), 400,
     b'{"error":{"code":"invalid_request","message":"bad","param":"x","status":400}}'),
])
def test_lmi_and_jobs_error_bodies_are_byte_exact(dialect, error, status, body):
    from api.dialects import error_body

    got_status, got = error_body(dialect, error)
    assert (got_status, encode(got)) == (status, body)


def oc_reqs(body: dict):
    return oc.to_generation_requests(msgspec.convert(body, oc.CompletionRequest))


def oc_req(body: dict):
    (req,) = oc_reqs(body)
    return req


def test_openai_defaults_match_vllm():
    req = oc_req({"prompt": "hi", "max_tokens": None})
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0
    assert oc_req({"prompt": [1, 2, 3]}).prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 2, "temperature": 0},
    {"prompt": "x", "stop": [""]},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "logit_bias": {"abc": 1.0}},
    {"prompt": []},
    {"prompt": ["a", [1, 2]]},
    {"prompt": [[1], []]},
    {"prompt": "x", "suffix": "y"},
    {"prompt": "x", "use_beam_search": True},
])
def test_openai_rejects_invalid_combinations(body):
    with pytest.raises(InvalidRequest):
        oc_req(body)


async def test_openai_stream_ends_with_done_after_an_in_band_error():
    req = oc_req({"prompt": "x", "stream": True})
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
              Error(seq=2, code="generation_failed", message="boom", status=500)]
    out = await frames(oc.CompletionStream(req, "id1", 123), events)
    assert out[-1] == SSE_DONE
    error = msgspec.json.decode(out[-2][len(b"data: "):])
    assert error["error"]["message"] == "boom" and error["error"]["code"] == 500
    assert out[0].startswith(b'data: {"id":"cmpl-id1","object":"text_completion","created":123')


def test_a_negative_prompt_token_id_is_the_clients_400_not_an_engine_failure():
    from api.submit import check_queueable

    (req,) = oc_reqs({"prompt": [5, -1]})
    with pytest.raises(InvalidRequest, match=r"prompt_token_ids\[1\]"):
        check_queueable(req)


def test_openai_prompt_lists_become_one_job_each():
    reqs = oc_reqs({"prompt": ["a", "b"], "n": 2, "temperature": 0.5})
    assert [r.prompt for r in reqs] == ["a", "b"] and all(r.sampling.n == 2 for r in reqs)
    assert [r.prompt_token_ids for r in oc_reqs({"prompt": [[1, 2], [3]]})] == [[1, 2], [3]]


def test_openai_batch_result_numbers_choices_across_prompts_and_echoes():
    reqs = oc_reqs({"prompt": ["ab", "cd"], "n": 2, "temperature": 0.5, "echo": True})
    results = [
        JobResult(choices=[Choice(index=i, text=f"{j}{i}", finish_reason="length") for i in range(2)],
                  usage=Usage(prompt_tokens=2, completion_tokens=2))
        for j in range(2)
    ]
    body = oc.render_results(reqs, results, "x", 1)
    assert [(c.index, c.text) for c in body.choices] == [(0, "ab00"), (1, "ab01"), (2, "cd10"), (3, "cd11")]
    assert body.usage == oc.CompletionUsage(prompt_tokens=4, completion_tokens=4, total_tokens=8)


def test_openai_echo_with_logprobs_prefixes_the_prompt_tokens():
    req = oc_req({"prompt": [1, 5], "echo": True, "logprobs": 1})
    assert req.sampling.prompt_logprobs == 1 and req.output.prompt_tokens
    prompt = PromptInfo(token_ids=[1, 5], token_texts=["<s>", "x"], logprobs=[None, -1.5],
                        top_logprobs=[[], [TopLogprob(5, "x", -1.5)]])
    choice = Choice(text="y", token_ids=[7], token_texts=["y"], logprobs=[-0.5],
                    top_logprobs=[[TopLogprob(7, "y", -0.5)]], finish_reason="length")
    body = oc.render_result(req, JobResult(choices=[choice], prompt=prompt), "x", 1)
    (c,) = body.choices
    assert c.text == "<s>xy"
    # Exact bytes: the legacy logprobs object's key order, and null (not {}) for the first token.
    assert encode(c.logprobs) == (b'{"text_offset":[0,3,4],"token_logprobs":[null,-1.5,-0.5],"tokens":["<s>","x","y"],'
                                  b'"top_logprobs":[null,{"x":-1.5},{"y":-0.5}]}')


async def test_openai_stream_chunks_have_usage_only_in_the_last_and_logprobs_offsets_run_on():
    req = oc_req({"prompt": "x", "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}})
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="ab", token_texts=["ab"], logprobs=[-0.5],
                                         top_logprobs=[[TopLogprob(1, "ab", -0.5)]])]),
        Done(seq=2, deltas=[TokenDelta(token_ids=[2], text="c", token_texts=["c"], logprobs=[-1.0], top_logprobs=[[]],
                                       finish_reason="stop", stop_reason="\n")],
             usage=Usage(prompt_tokens=1, completion_tokens=2)),
    ]
    head = b'data: {"id":"cmpl-s","object":"text_completion","created":9,"model":"",'
    assert await frames(oc.CompletionStream(req, "s", 9), events) == [
        head + b'"choices":[{"index":0,"text":"ab","logprobs":{"text_offset":[0],"token_logprobs":[-0.5],'
        b'"tokens":["ab"],"top_logprobs":[{"ab":-0.5}]},"finish_reason":null,"stop_reason":null}]}\n\n',
        head + b'"choices":[{"index":0,"text":"c","logprobs":{"text_offset":[2],"token_logprobs":[-1.0],'
        b'"tokens":["c"],"top_logprobs":[{}]},"finish_reason":"stop","stop_reason":"\\n"}]}\n\n',
        head + b'"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}\n\n',
        SSE_DONE,
    ]


def test_sse_framing_helper():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse({"a": 1}, space=False) == b'data:{"a":1}\n\n'
    assert sse({"a": 1}, event_id=7) == b'id: 7\ndata: {"a":1}\n\n'


def test_openai_completions_take_structured_outputs_and_response_format():
    so = oc_req({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}}).sampling.structured
    assert so is not None and so.regex == "[0-9]+"
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert oc_req({"prompt": "x", "response_format": rf}).sampling.structured.json == schema
    with pytest.raises(InvalidRequest):
        oc_req({"prompt": "x", "response_format": {"type": "json_schema"}})


def test_lmi_structured_outputs_reach_the_internal_request():
    so = lmi_req({"inputs": "x", "parameters": {"structured_outputs": {"regex": "a+"}}}).sampling.structured
    assert so is not None and so.regex == "a+"
    with pytest.raises(InvalidRequest):
        lmi_req({"inputs": "x", "parameters": {"structured_outputs": {"regex": "a", "choice": ["b"]}}})


def test_every_dialect_name_has_a_dialect_and_every_route_speaks_one():
    """No fallback: a name without a dialect would fail at render time, so none may exist."""
    import typing

    from api import dialects
    from api.app import create_app
    from shared.config import load_settings
    from shared.schemas import DialectName

    names = set(typing.get_args(DialectName))
    assert names == set(dialects._DIALECTS)
    app = create_app(load_settings({}))
    handlers = [h for route in app.routes
                for h in getattr(route, "route_handlers", None) or [route.route_handler]]  # type: ignore[attr-defined]
    spoken = {h.opt.get("dialect", "jobs") for h in handlers}
    assert spoken == names - {"lmi_tgi", "lmi_batch"}, spoken  # every dialect but LMI's two other shapes


def test_a_request_naming_no_known_dialect_is_refused_when_decoded():
    import msgspec

    from shared.codec import decode_request
    from shared.schemas import GenerationRequest

    good = msgspec.json.encode(GenerationRequest(prompt="p", dialect="tgi"))
    assert decode_request(good).dialect == "tgi"
    with pytest.raises(msgspec.ValidationError, match="dialect"):
        decode_request(good.replace(b'"tgi"', b'"nonesuch"'))
