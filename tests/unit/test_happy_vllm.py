"""happy_vllm legacy generate: translation, validation messages, rendering bytes."""

from __future__ import annotations

import json

import pytest

from api.dialects import happy_vllm as hv
from shared.codec import encode
from shared.errors import InvalidRequest, QueueUnavailable
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import Keepalive
from shared.schemas import Choice, JobResult, PromptInfo, StructuredOutput, Usage
from tests.support.streams import frames


def req(body: dict, stream: bool = False):
    return hv.to_generation_request(hv.read_body(body), stream=stream)


def compact(expected: object) -> bytes:
    """``expected`` written as ``shared.codec.encode`` writes JSON (key order kept)."""
    return json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()


def invalid(body: dict) -> str:
    with pytest.raises(InvalidRequest) as info:
        req(body)
    status, payload = hv.error_body(info.value)
    assert status == 422 and encode(payload) == encode({"detail": payload.detail})
    return payload.detail


def test_defaults_are_vllm_sampling_params_defaults():
    r = req({"prompt": "hi"})
    s = r.sampling
    assert (r.prompt, r.dialect, r.model) == ("hi", "happy_vllm", "")
    assert (s.n, s.temperature, s.top_p, s.max_tokens, s.structured) == (1, 1.0, 1.0, 16, None)
    assert not r.output.echo and not r.output.prompt_tokens


def test_vllm_keywords_pass_through_with_lenient_values():
    r = req(
        {
            "prompt": "x",
            "temperature": 0,
            "top_p": "0.8",
            "max_tokens": 50,
            "repetition_penalty": 1,
            "stop": "\n",
            "n": 2,
            "seed": 7,
            "min_tokens": 2,
            "ignore_eos": "true",
            "logit_bias": {"5": -1.5},
            "stop_token_ids": [2],
            "top_k": 3,
            "prompt_in_response": True,
        }
    )
    s = r.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.repetition_penalty) == (0.0, 0.8, 50, 1.0)
    assert (s.stop, s.n, s.seed, s.min_tokens, s.ignore_eos) == (["\n"], 2, 7, 2, True)
    assert (s.logit_bias, s.stop_token_ids, s.top_k) == ({5: -1.5}, [2], 3)
    assert r.output.echo


def test_null_keywords_mean_the_vllm_default():
    s = req({"prompt": "x", "seed": None, "stop": None, "prompt_in_response": None}).sampling
    assert s.seed is None and s.stop == []
    assert "max_tokens=null" in invalid({"prompt": "x", "max_tokens": None})


def test_stream_asks_the_worker_for_prompt_tokens():
    assert req({"prompt": "x"}, stream=True).output.prompt_tokens


def test_unknown_or_unmapped_keywords_are_refused_by_name_with_the_accepted_list():
    detail = invalid({"prompt": "x", "use_beam_search": True, "best_of": 2})
    assert detail.startswith("Unsupported sampling parameter(s): best_of, use_beam_search. llmq accepts")
    for key in hv.ACCEPTED_SAMPLING_KEYS:
        assert key in detail
    assert "reserved by happy_vllm" in invalid({"prompt": "x", "logits_processors": []})


def test_bad_values_and_missing_prompt_are_422():
    assert invalid({"max_tokens": 3}) == "field required: `prompt`"
    assert "$.prompt" in invalid({"prompt": 5})
    assert invalid({"prompt": "x", "temperature": 3}) == (
        "Invalid sampling parameter: Expected `float` <= 2.0 - at `$.temperature`"
    )
    assert "min_tokens" in invalid({"prompt": "x", "max_tokens": 2, "min_tokens": 5})
    assert "stop strings" in invalid({"prompt": "x", "stop": ["a", ""]})


def test_response_pool_is_a_choice_and_keeps_happy_vllm_incompatibilities():
    s = req({"prompt": "x", "response_pool": ["yes", "no"]}).sampling
    assert s.structured == StructuredOutput(choice=["yes", "no"])
    assert req({"prompt": "x", "response_pool": []}).sampling.structured is None
    assert invalid({"prompt": "x", "response_pool": ["a"], "json_format": {"a": "string"}}) == (
        "Two keywords are incompatible : response_pool and json_format"
    )
    # happy_vllm checked the keys' presence, even when empty
    assert "incompatible" in invalid({"prompt": "x", "response_pool": [], "json_format": None})
    assert invalid({"prompt": "x", "response_pool": ["a"], "min_tokens": 2}) == (
        "min_tokens : 2 is incompatible with the `response_pool` keyword"
    )
    assert req({"prompt": "x", "response_pool": [], "min_tokens": 2}).sampling.min_tokens == 2


def test_simple_json_format_becomes_happy_vllms_schema():
    fmt = {"name": "string", "age": "integer", "alive": "boolean", "height": "number", "kids": ["string"]}
    so = req({"prompt": "x", "json_format": fmt}).sampling.structured
    assert so.json == {
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "alive": {"type": "boolean"},
            "height": {"type": "number"},
            "kids": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "alive", "height", "kids"],
        "title": "simple_json",
        "type": "object",
    }
    assert req({"prompt": "x", "json_format": {}}).sampling.structured is None


def test_json_schema_mode_passes_the_schema_through_and_simple_mode_checks_types():
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    so = req({"prompt": "x", "json_format": schema, "json_format_is_json_schema": True}).sampling.structured
    assert so.json == schema
    assert invalid({"prompt": "x", "json_format": {"a": "date"}}) == (
        "The value date corresponding to the keyword a is not in ['string', 'integer', 'boolean', 'number']"
    )
    assert "not composed of a single element" in invalid({"prompt": "x", "json_format": {"a": ["string", "number"]}})
    assert "single element in not in" in invalid({"prompt": "x", "json_format": {"a": ["date"]}})


def test_render_result_has_one_entry_per_choice_and_the_string_None():
    r = req({"prompt": "p", "n": 2, "prompt_in_response": True})
    result = JobResult(
        choices=[
            Choice(index=0, text="ab", token_ids=[1, 2], finish_reason="stop"),
            Choice(index=1, text="c", token_ids=[3], finish_reason=None),
        ],
        usage=Usage(prompt_tokens=4, completion_tokens=3),
    )
    assert encode(hv.render_result(r, result)) == compact({
        "responses": ["ab", "c"],
        "finish_reasons": ["stop", "None"],
        "usages": [
            {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
        ],
        "prompt": "p",
    })
    assert b'"prompt"' not in encode(hv.render_result(req({"prompt": "p"}), result))


async def _stream(r, events) -> bytes:
    return b"".join(await frames(hv.GenerateStream(r), events))


async def test_stream_lines_are_cumulative_json_dumps_with_the_string_None():
    r = req({"prompt": "héllo"}, stream=True)
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")], prompt=PromptInfo(token_ids=[9, 9, 9])),
        Keepalive(),
        Tokens(seq=2, deltas=[TokenDelta(token_ids=[2, 3], text="bé")]),
        Done(
            seq=3,
            deltas=[TokenDelta(token_ids=[4], text="c", finish_reason="length")],
            usage=Usage(prompt_tokens=3, completion_tokens=4),
        ),
    ]
    u = '"usages": [{"prompt_tokens": 3, "completion_tokens": %d, "total_tokens": %d}]'
    assert await _stream(r, events) == (
        b'{"responses": ["a"], "finish_reasons": ["None"], ' + (u % (1, 4)).encode() + b"}\n"
        b'{"responses": ["ab\\u00e9"], "finish_reasons": ["None"], ' + (u % (3, 6)).encode() + b"}\n"
        b'{"responses": ["ab\\u00e9c"], "finish_reasons": ["length"], ' + (u % (4, 7)).encode() + b"}\n"
    )


async def test_stream_n2_prompt_in_response_and_an_empty_done():
    r = req({"prompt": "p", "n": 2, "prompt_in_response": True}, stream=True)
    events = [
        Tokens(
            seq=1,
            deltas=[TokenDelta(index=1, token_ids=[1], text="x", finish_reason="stop")],
            prompt=PromptInfo(token_ids=[5]),
        ),
        Tokens(seq=2, deltas=[TokenDelta(index=0, token_ids=[2], text="y", finish_reason="length")]),
        Done(seq=3, usage=Usage(prompt_tokens=1, completion_tokens=2)),
    ]
    lines = [json.loads(x) for x in (await _stream(r, events)).splitlines()]
    assert [x["responses"] for x in lines] == [["", "x"], ["y", "x"]]
    assert [x["finish_reasons"] for x in lines] == [["None", "stop"], ["length", "stop"]]
    assert all(x["prompt"] == "p" for x in lines)
    assert lines[0]["usages"][0] == {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}


async def test_stream_error_after_the_first_line_ends_with_a_detail_line():
    r = req({"prompt": "p"}, stream=True)
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="a")]),
        Error(seq=2, code="generation_failed", message="engine died", status=500),
    ]
    assert (await _stream(r, events)).splitlines()[-1] == b'{"detail": "engine died"}'


def test_error_body_keeps_service_statuses():
    status, body = hv.error_body(QueueUnavailable("no worker"))
    assert (status, encode(body)) == (503, b'{"detail":"no worker"}')
    status, body = hv.error_body(InvalidRequest("bad"))
    assert (status, encode(body)) == (422, b'{"detail":"bad"}')
