"""Dialect translation and rendering, without a server."""

from __future__ import annotations

import msgspec
import pytest

from api.dialects import lmi
from api.dialects import openai_completions as oc
from api.relay import SSE_DONE, Keepalive, sse
from shared.errors import InvalidRequest
from shared.events import Done, Error, TokenDelta, Tokens
from shared.schemas import Usage


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


def test_lmi_rejects_what_it_cannot_do_yet():
    with pytest.raises(InvalidRequest):
        lmi_req({"inputs": "x", "parameters": {"n": 2}})


async def _aiter(items):
    for item in items:
        yield item


async def test_lmi_stream_error_after_first_token_ends_with_the_documented_error_line():
    req = lmi_req({"inputs": "x"})
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a", token_texts=["a"], logprobs=[-1.0])]),
              Keepalive(), Error(seq=2, code="generation_failed", message="engine died", status=500)]
    lines = [msgspec.json.decode(x) async for x in lmi.render_stream(req, _aiter(events), sse_format=False)]
    assert lines[0] == {"token": {"id": 1, "text": "a", "log_prob": -1.0}}
    assert lines[1]["details"] == {"finish_reason": "error", "generated_tokens": None, "inputs": None}
    assert lines[1]["token"]["id"] == -1 and lines[1]["generated_text"] == ""


async def test_lmi_sse_frames_are_data_space_json():
    req = lmi_req({"inputs": "x"})
    done = Done(seq=1, deltas=[TokenDelta(token_ids=[9], text="z", token_texts=["z"], logprobs=[-0.5],
                                          finish_reason="stop")], usage=Usage(completion_tokens=1))
    frames = [f async for f in lmi.render_stream(req, _aiter([done]), sse_format=True)]
    assert frames == [b'data: {"token":{"id":9,"text":"z","log_prob":-0.5},"generated_text":"z"}\n\n']


def test_lmi_finish_reasons_use_lmi_vocabulary():
    assert lmi._finish_reason("length", None) == "length"
    assert lmi._finish_reason("stop", None) == "eos_token"
    assert lmi._finish_reason("stop", "\n") == "stop_sequence"


def oc_req(body: dict):
    return oc.to_generation_request(msgspec.convert(body, oc.CompletionRequest))


def test_openai_defaults_match_vllm():
    req = oc_req({"prompt": "hi", "max_tokens": None})
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0
    assert oc_req({"prompt": [1, 2, 3]}).prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 2, "temperature": 0},
    {"prompt": "x", "stop": [""]},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "logit_bias": {"abc": 1.0}},
    {"prompt": ["a", "b"]},
])
def test_openai_rejects_invalid_combinations(body):
    with pytest.raises(InvalidRequest):
        oc_req(body)


async def test_openai_stream_ends_with_done_after_an_in_band_error():
    req = oc_req({"prompt": "x", "stream": True})
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
              Error(seq=2, code="generation_failed", message="boom", status=500)]
    frames = [f async for f in oc.render_stream(req, _aiter(events), "id1", 123)]
    assert frames[-1] == SSE_DONE
    error = msgspec.json.decode(frames[-2][len(b"data: "):])
    assert error["error"]["message"] == "boom" and error["error"]["code"] == 500
    assert frames[0].startswith(b'data: {"id":"cmpl-id1","object":"text_completion","created":123')


def test_sse_framing_helper():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse({"a": 1}, space=False) == b'data:{"a":1}\n\n'
    assert sse({"a": 1}, event_id=7) == b'id: 7\ndata: {"a":1}\n\n'
