"""LMTP translation and rendering without a socket: frame parsing, payload validation, the
GenerationRequest each command becomes, and the exact TOKEN / MSG text."""

from __future__ import annotations

import json

import pytest

from api.dialects import lmtp
from shared.codec import encode
from shared.errors import InvalidRequest, ModelNotFound, ServiceError
from shared.events import Done, Error, TokenDelta, Tokens
from shared.schemas import Choice, GenerationRequest, JobResult, OutputOptions, PromptInfo, TopLogprob


def frame_of(text: str) -> lmtp.Frame:
    return lmtp.parse_frame(text)


def test_parse_splits_on_the_first_space_and_reads_the_stream_id():
    f = frame_of('GENERATE {"prompt": [1, 2], "stream_id": 3, "model": "m x"}')
    assert (f.verb, f.stream_id) == ("GENERATE", 3)
    assert json.loads(f.payload)["model"] == "m x"


@pytest.mark.parametrize(
    ("text", "message", "stream_id"),
    [
        ("GENERATE", "malformed LMTP message: expected '<VERB> <json>', got 'GENERATE'", None),
        ("GENERATE   ", "malformed LMTP message", None),
        ("GENERATE {nope", "malformed JSON in GENERATE message", None),
        ("GENERATE [1, 2]", "the payload of GENERATE must be a JSON object", None),
    ],
)
def test_unparseable_frames_raise_frame_errors(text, message, stream_id):
    with pytest.raises(lmtp.FrameError) as info:
        frame_of(text)
    assert info.value.message.startswith(message)
    assert info.value.stream_id == stream_id


def test_generate_defaults_are_lmqls_servers():
    cmd = lmtp.decode_generate(frame_of('GENERATE {"prompt": [1], "stream_id": 1}'))
    assert (cmd.temperature, cmd.max_tokens, cmd.top_logprobs, cmd.logit_bias, cmd.model) == (0.0, 32, 1, None, "")


def test_generate_translates_to_one_token_id_job():
    text = (
        'GENERATE {"model": "m", "prompt": [1, 5, 9], "stream_id": 2, "max_tokens": 16, "temperature": 0.7, '
        '"top_logprobs": 1, "logit_bias": {"81": 100, "92": 100}, "top_p": 0.9, "top_k": 40, '
        '"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "length_penalty": 1.0, '
        '"unknown_extra": true}'
    )
    req = lmtp.to_generation_request(lmtp.decode_generate(frame_of(text)))
    assert req.model == "m" and req.prompt_token_ids == [1, 5, 9] and req.dialect == "lmtp"
    s = req.sampling
    assert (s.temperature, s.max_tokens, s.logprobs, s.top_p, s.top_k) == (0.7, 16, 1, 0.9, 40)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)
    assert s.logit_bias == {81: 100.0, 92: 100.0}  # string keys become token ids
    assert s.prompt_logprobs is None and not req.output.prompt_tokens


def test_masked_beams_ask_the_engine_for_spare_alternatives():
    def asked(k: int, bias: dict | None) -> int | None:
        payload = {"prompt": [1], "stream_id": 1, "top_logprobs": k, "logit_bias": bias}
        return lmtp.to_generation_request(
            lmtp.decode_generate(frame_of("GENERATE " + json.dumps(payload)))
        ).sampling.logprobs

    assert asked(1, {"5": -100}) == 1  # the sampled token is always reported: nothing to spare
    assert asked(2, None) == 2
    assert asked(2, {"5": -100}) == 4
    assert asked(15, {"5": 100}) == 20
    assert asked(2, {"5": 3.0}) == 2  # a small bias is not a mask


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"stream_id": 1}, "Object missing required field `prompt`"),
        ({"stream_id": 1, "prompt": []}, "at `$.prompt`"),
        ({"stream_id": 1, "prompt": ["a"]}, "Expected `int`, got `str` - at `$.prompt[0]`"),
        ({"stream_id": 1, "prompt": [1], "max_tokens": 0}, "Expected `int` >= 1 - at `$.max_tokens`"),
        ({"stream_id": 1, "prompt": [1], "temperature": -1}, "at `$.temperature`"),
        (
            {"stream_id": 1, "prompt": [1], "logit_bias": {"x": 1}},
            "Expected `int`, got `str` - at `key` in `$.logit_bias`",
        ),
    ],
)
def test_invalid_generate_payloads_name_the_field(payload, fragment):
    with pytest.raises(InvalidRequest) as info:
        lmtp.decode_generate(frame_of("GENERATE " + json.dumps(payload)))
    assert info.value.message.startswith("invalid GENERATE payload: ")
    assert fragment in info.value.message


def test_score_is_prompt_logprobs_of_prompt_plus_scored():
    cmd = lmtp.decode_score(frame_of('SCORE {"model": "m", "prompt": [1, 2], "scored": [3, 4], "stream_id": 9}'))
    req = lmtp.to_score_request(cmd)
    assert req.prompt_token_ids == [1, 2, 3, 4] and req.model == "m"
    assert (req.sampling.max_tokens, req.sampling.prompt_logprobs, req.sampling.temperature) == (1, 0, 0.0)
    assert req.output.prompt_tokens


def delta(ids, *, lps=None, tops=None, reason=None) -> TokenDelta:
    return TokenDelta(token_ids=ids, logprobs=lps, top_logprobs=tops, finish_reason=reason)


def gen(**kw) -> lmtp.Generate:
    return lmtp.Generate(stream_id=kw.pop("stream_id", 4), prompt=[1], **kw)


def test_one_frame_per_token_and_finish_reason_only_on_the_last():
    stream = lmtp.TokenStream(gen())
    first = stream.feed(Tokens(seq=1, deltas=[delta([10, 11], lps=[-1.0, -2.0])]))
    last = stream.feed(Done(seq=2, deltas=[delta([12], lps=[-3.0], reason="length")]))
    out = first + last
    assert [p.token for p in first] == [10]  # 11 is held until we know whether it is the last
    assert [(p.token, p.logprob, p.finish_reason) for p in out] == [
        (10, -1.0, None),
        (11, -2.0, None),
        (12, -3.0, "length"),
    ]
    assert all(p.stream_id == 4 for p in out)


def test_a_final_event_without_tokens_finishes_the_held_token():
    stream = lmtp.TokenStream(gen())
    out = stream.feed(Tokens(seq=1, deltas=[delta([10, 2], lps=[-1.0, -0.5])]))
    out += stream.feed(Done(seq=2, deltas=[delta([], reason="stop")]))
    assert [(p.token, p.finish_reason) for p in out] == [(10, None), (2, "stop")]


def test_a_final_event_with_no_token_at_all_is_an_error():
    with pytest.raises(ServiceError, match="without generating a token"):
        lmtp.TokenStream(gen()).feed(Done(seq=1, deltas=[]))


@pytest.mark.parametrize(("vllm", "lmtp_reason"), [("stop", "stop"), ("length", "length"), ("abort", "stop")])
def test_finish_reasons_map_to_lmtps_two(vllm, lmtp_reason):
    [p] = lmtp.TokenStream(gen()).feed(Done(seq=1, deltas=[delta([7], lps=[-1.0], reason=vllm)]))
    assert p.finish_reason == lmtp_reason


def tops(*pairs) -> list[TopLogprob]:
    return [TopLogprob(t, "", lp) for t, lp in pairs]


def test_top_logprobs_put_the_sampled_token_first_then_the_best_k():
    stream = lmtp.TokenStream(gen(top_logprobs=2))
    [p] = stream.feed(Done(seq=1, deltas=[delta([12], lps=[-0.5], tops=[tops((5, -0.25), (12, -0.5), (6, -1.5))])]))
    assert list(p.top_logprobs.items()) == [("12", -0.5), ("5", -0.25)]


@pytest.mark.parametrize(
    ("bias", "expected"),
    [
        ({5: -100.0}, {"12": -0.5, "6": -1.5}),  # deny mask: 5 was banned
        ({12: 100.0, 6: 100.0}, {"12": -0.5, "6": -1.5}),  # allow mask: only 12 and 6 allowed
        ({5: -3.0}, {"12": -0.5, "5": -0.25}),  # an ordinary bias is not a mask
    ],
)
def test_masked_alternatives_are_dropped(bias, expected):
    stream = lmtp.TokenStream(gen(top_logprobs=2, logit_bias=bias))
    position = tops((5, -0.25), (12, -0.5), (6, -1.5), (7, -2.0))
    [p] = stream.feed(Done(seq=1, deltas=[delta([12], lps=[-0.5], tops=[position])]))
    assert p.top_logprobs == expected


def test_other_choices_are_ignored_and_infinite_logprobs_stay_finite():
    stream = lmtp.TokenStream(gen())
    [p] = stream.feed(
        Done(
            seq=1,
            deltas=[
                delta([9], lps=[float("-inf")], reason="length"),
                TokenDelta(index=1, token_ids=[3], finish_reason="length"),
            ],
        )
    )
    assert p.token == 9 and p.logprob == -1e30 and p.top_logprobs == {"9": -1e30}


def score_cmd(prompt, scored) -> lmtp.Score:
    return lmtp.Score(stream_id=8, prompt=prompt, scored=scored)


def test_score_stream_waits_for_the_job_then_sends_every_scored_token():
    stream = lmtp.ScoreStream(score_cmd([1, 2], [3, 4]))
    info = PromptInfo(token_ids=[1, 2, 3, 4], logprobs=[None, -1.0, -2.0, -3.0])
    assert stream.feed(Tokens(seq=1, deltas=[delta([7])], prompt=info)) == []
    out = stream.feed(Done(seq=2, deltas=[delta([7], reason="length")]))
    assert out == [
        lmtp.TokenPayload(token=3, stream_id=8, logprob=-2.0, finish_reason=None),
        lmtp.TokenPayload(token=4, stream_id=8, logprob=-3.0, finish_reason="stop"),
    ]
    # A scored token has no alternatives: no top_logprobs key at all.
    assert lmtp.frame("TOKEN", out[1]) == (
        'TOKEN [{"token": 4, "stream_id": 8, "logprob": -3.0, "finish_reason": "stop"}]'
    )


def test_score_of_the_first_token_is_zero_as_lmql_reports_it():
    out = lmtp.score_payloads(8, 0, [1, 2], PromptInfo(token_ids=[1, 2], logprobs=[None, -0.5]))
    assert [(p.token, p.logprob) for p in out] == [(1, 0.0), (2, -0.5)]


@pytest.mark.parametrize(
    "info", [None, PromptInfo(token_ids=[1, 3]), PromptInfo(token_ids=[1, 9], logprobs=[None, -1.0])]
)
def test_score_without_matching_prompt_logprobs_is_an_error(info):
    with pytest.raises(ServiceError, match="did not report logprobs"):
        lmtp.score_payloads(8, 1, [3], info)


def test_frames_are_byte_compatible_with_lmqls_server():
    payload = lmtp.TokenPayload(token=12, stream_id=1, logprob=-0.5, top_logprobs={"12": -0.5, "7": -1e30})
    assert lmtp.frame("TOKEN", payload) == (
        'TOKEN [{"token": 12, "stream_id": 1, "logprob": -0.5, "finish_reason": null, '
        '"top_logprobs": {"12": -0.5, "7": -1e+30}}]'
    )
    # A stream id the client sent that is not an integer is echoed back as it came.
    assert lmtp.frame("MSG", lmtp.error_payload({"a": [1, 2.5]}, "é")) == (
        'MSG [{"stream_id": {"a": [1, 2.5]}, "error": "\\u00e9"}]'
    )
    assert lmtp.frame("MSG", lmtp.error_payload(None, "bad")) == 'MSG [{"stream_id": null, "error": "bad"}]'
    assert lmtp.frame("TOKEN", lmtp.error_payload(3, "boom")) == 'TOKEN [{"stream_id": 3, "error": "boom"}]'
    assert lmtp.frame("MSG", lmtp.model_info_payload(2, "tiny", 1, 1024)) == (
        'MSG [{"stream_id": 2, "model_info": {"model": "tiny", "model_type": "llmq", "ready_workers": 1, '
        '"max_model_len": 1024}}]'
    )


def test_render_result_for_the_job_view():
    req = GenerationRequest(prompt_token_ids=[1], dialect="lmtp")
    result = JobResult(choices=[Choice(token_ids=[5, 6], logprobs=[-1.0, -2.0], finish_reason="stop")])
    assert encode(lmtp.render_result(req, result, "j", 0)) == (
        b'[{"token":5,"logprob":-1.0,"finish_reason":null},{"token":6,"logprob":-2.0,"finish_reason":"stop"}]'
    )
    scored = GenerationRequest(prompt_token_ids=[1, 2], output=OutputOptions(prompt_tokens=True), dialect="lmtp")
    result = JobResult(prompt=PromptInfo(token_ids=[1, 2], logprobs=[None, -0.5]))
    assert encode(lmtp.render_result(scored, result, "j", 0)) == (
        b'[{"token":1,"logprob":0.0},{"token":2,"logprob":-0.5}]'
    )


def test_error_body_keeps_the_status():
    status, body = lmtp.error_body(ModelNotFound("no such model"))
    assert (status, encode(body)) == (404, b'{"error":"no such model"}')


def test_error_events_are_not_rendered_as_tokens():
    assert lmtp.TokenStream(gen()).feed(Error(seq=1, code="x", message="y")) == []
