"""TGI dialect without a server: validation (TGI's own rules and messages), translation, rendering."""

from __future__ import annotations

import json

import msgspec
import pytest

from api.dialects import tgi
from api.dialects.tgi import TgiStream
from shared.codec import encode
from shared.errors import GenerationFailed, InvalidRequest, QueueUnavailable, ServiceError, error_from_code
from shared.events import Done, Error, TokenDelta, Tokens
from shared.framing import KEEPALIVE, Keepalive
from shared.schemas import Choice, JobResult, PromptInfo, TopLogprob, Usage
from tests.support.streams import frames

LIMIT = 1024


def wire(obj) -> object:
    """What a client reads: the response Structs encoded, then parsed."""
    return json.loads(encode(obj))


def exact(obj, expected) -> None:
    """The encoded bytes are ``expected`` written compactly, key order and nulls included."""
    assert encode(obj) == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()


def translate(body: dict, *, stream: bool = False, compat: bool = False):
    return tgi.to_generation_request(
        msgspec.convert(body, tgi.GenerateRequest), stream=stream, max_total_tokens=LIMIT, compat=compat
    )


def rejected(params: dict, *, stream: bool = False, inputs: str = "hi") -> str:
    with pytest.raises(InvalidRequest) as info:
        translate({"inputs": inputs, "parameters": params}, stream=stream)
    status, body = tgi.error_body(info.value)
    assert status == 422 and body.error_type == "validation"
    return body.error


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"truncate": 0}, "`truncate` must be strictly positive and less than 1023. Given: 0"),
        ({"truncate": 5000}, "`truncate` must be strictly positive and less than 1023. Given: 5000"),
        ({"max_new_tokens": 1024}, "`max_new_tokens` must be <= 1023. Given: 1024"),
        (
            {"grammar": {"type": "json", "value": {"type": "object"}}},
            "grammar is not valid: Grammar must have a 'properties' field",
        ),
        ({"grammar": {"type": "json", "value": "{not json"}}, "grammar is not valid: "),
        ({"grammar": {"type": "json", "value": 5}}, "grammar is not supported"),
        ({"grammar": {"type": "json_schema", "value": {"name": "x"}}}, "grammar is not valid: missing field `schema`"),
        ({"grammar": {"type": "regex", "value": "(unclosed"}}, "grammar is not valid: "),
    ],
)
def test_validation_messages_are_tgis_with_its_prefix(params, message):
    assert rejected(params).startswith("Input validation error: " + message)


def test_streaming_refuses_best_of_and_decoder_input_details_first():
    # Checked before anything else, as generate_stream_internal does.
    assert rejected({"best_of": 2, "top_p": 1.0}, stream=True).endswith(
        "`best_of` != 1 is not supported when streaming tokens"
    )
    assert rejected({"decoder_input_details": True}, stream=True).endswith(
        "`decoder_input_details` == true is not supported when streaming tokens"
    )


def test_empty_inputs_and_what_vllm_cannot_do_are_refused():
    assert rejected({}, inputs="").endswith("`inputs` cannot be empty")
    assert "`typical_p` is not supported" in rejected({"typical_p": 0.5})
    assert "`watermark` is not supported" in rejected({"watermark": True})
    # adapter_id names a LoRA adapter, resolved at admission as any dialect's model is.
    assert translate({"inputs": "x", "parameters": {"adapter_id": "lora"}}).model == "lora"
    assert translate({"inputs": "x"}).model == ""
    translate({"inputs": "x", "parameters": {"watermark": False}})  # false is fine


def test_type_errors_fail_decoding():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"inputs": "x", "parameters": {"max_new_tokens": -1}}, tgi.GenerateRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"inputs": "x", "parameters": {"grammar": {"type": "ebnf", "value": ""}}}, tgi.GenerateRequest)


# --- translation ----------------------------------------------------------------------------


def test_missing_parameters_samples_but_an_empty_object_is_greedy():
    assert translate({"inputs": "x"}).sampling.temperature == 1.0  # default_parameters(): do_sample
    greedy = translate({"inputs": "x", "parameters": {}}).sampling
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.seed) == (0.0, 1.0, 0, None)


def test_warpers_imply_sampling_as_tgis_server_decides():
    assert translate({"inputs": "x", "parameters": {"temperature": 0.5}}).sampling.temperature == 0.5
    assert translate({"inputs": "x", "parameters": {"top_k": 5}}).sampling.top_k == 5
    assert translate({"inputs": "x", "parameters": {"top_p": 0.9}}).sampling.top_p == 0.9
    # temperature 1.0 changes nothing: still greedy without do_sample
    assert translate({"inputs": "x", "parameters": {"temperature": 1.0}}).sampling.temperature == 0.0
    s = translate({"inputs": "x", "parameters": {"do_sample": True, "seed": 7}}).sampling
    assert (s.temperature, s.seed) == (1.0, 7)
    assert translate({"inputs": "x", "parameters": {"seed": 7}}).sampling.seed is None  # greedy: no seed


def test_parameters_map_to_sampling_and_output():
    req = translate(
        {
            "inputs": "Hello",
            "parameters": {
                "max_new_tokens": 9,
                "stop": ["\n", ""],
                "repetition_penalty": 1.2,
                "frequency_penalty": 0.5,
                "top_n_tokens": 3,
                "details": True,
                "return_full_text": True,
            },
        }
    )
    s = req.sampling
    assert (s.max_tokens, s.stop, s.repetition_penalty, s.frequency_penalty) == (9, ["\n"], 1.2, 0.5)
    assert s.logprobs == 3 and s.include_stop_str_in_output and s.n == 1
    assert req.output.details and req.output.return_full_text and req.dialect == "tgi" and req.prompt == "Hello"
    assert translate({"inputs": "x", "parameters": {}}).sampling.logprobs == 0  # every token has a logprob
    assert translate({"inputs": "x", "parameters": {}}).sampling.max_tokens == 1023  # min(1024, total - 1)


def test_compat_route_defaults_return_full_text_to_true():
    assert translate({"inputs": "x", "parameters": {}}, compat=True).output.return_full_text
    assert not translate({"inputs": "x", "parameters": {}}).output.return_full_text
    assert not translate(
        {"inputs": "x", "parameters": {"return_full_text": False}}, compat=True
    ).output.return_full_text


def test_best_of_decoder_input_details_and_grammar():
    req = translate({"inputs": "x", "parameters": {"best_of": 2, "do_sample": True, "decoder_input_details": True}})
    assert req.sampling.n == 2 and req.sampling.logprobs == 0
    assert req.output.prompt_tokens and req.sampling.prompt_logprobs == 0 and req.output.details
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for grammar in (
        {"type": "json", "value": schema},
        {"type": "json_object", "value": json.dumps(schema)},
        {"type": "json_schema", "value": {"name": "s", "schema": schema}},
    ):
        assert translate({"inputs": "x", "parameters": {"grammar": grammar}}).sampling.structured.json == schema
    regex = translate({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "[0-9]+"}}})
    assert regex.sampling.structured.regex == "[0-9]+"


# --- rendering ------------------------------------------------------------------------------


def test_finish_reasons():
    assert tgi.finish_reason("length", None) == "length"
    assert tgi.finish_reason("stop", None) == "eos_token"
    assert tgi.finish_reason("stop", 2) == "eos_token"
    assert tgi.finish_reason("stop", "\n") == "stop_sequence"


def test_tokens_mark_eos_and_special_ids_and_keep_texts_adding_up():
    toks = tgi.TokenTexts().tokens([5, 6, 2], ["He", "llo", "</s>"], "Hello", [-1.0, -0.5, -0.1], "stop", None)
    exact(toks, [
        {"id": 5, "text": "He", "logprob": -1.0, "special": False},
        {"id": 6, "text": "llo", "logprob": -0.5, "special": False},
        {"id": 2, "text": "</s>", "logprob": -0.1, "special": True},
    ])
    # A special id from the tokenizer, mid-sequence (the engine skips its text).
    mid = tgi.TokenTexts(frozenset({0})).tokens([5, 0, 6], ["a", "<unk>", "b"], "ab", None, "length")
    assert [(t.text, t.special) for t in mid] == [("a", False), ("<unk>", True), ("b", False)]
    assert mid[0].logprob is None
    # A stop string ends inside the last token: it gets what the engine kept.
    cut = tgi.TokenTexts().tokens([7, 8], ["x", "\nyz"], "x\n", None, "stop", "\n")
    assert [t.text for t in cut] == ["x", "\n"]


# (ids, each token decoded alone, the incremental text each token released when alone in a step)
SPLIT_CHAR = ([9, 10, 11], ["\ufffd", "\ufffd", "x"], ["", "é", "x"])
INVALID_BYTE = ([55, 8, 12], ["\ufffd", "T", "y"], ["", "\ufffdT", "y"])
LEADING_SPACE = ([3, 4], ["the", " fox"], [" the", " fox"])


@pytest.mark.parametrize("case", [SPLIT_CHAR, INVALID_BYTE, LEADING_SPACE])
@pytest.mark.parametrize("grouping", [[1, 1, 1], [2, 1], [1, 2], [3]])
def test_token_texts_do_not_depend_on_how_the_engine_grouped_the_steps(case, grouping):
    ids, alone, released = case
    n = len(ids)
    groups, start = [], 0
    for size in grouping:
        if start < n:
            groups.append(range(start, min(n, start + size)))
            start += size
    texts = tgi.TokenTexts()
    got = []
    for g in groups:
        last = g[-1] == n - 1
        got += texts.tokens(
            [ids[i] for i in g],
            [alone[i] for i in g],
            "".join(released[i] for i in g),
            None,
            "length" if last else None,
        )
    assert [t.text for t in got] == released


def _req(params: dict, **kw):
    return translate({"inputs": "Hi", "parameters": params}, **kw)


def test_render_result_plain_and_details_with_prefill_and_top_tokens():
    req = _req({"details": True, "decoder_input_details": True, "top_n_tokens": 1, "return_full_text": True})
    choice = Choice(
        text="ab",
        token_ids=[97, 98],
        token_texts=["a", "b"],
        logprobs=[-0.5, -0.25],
        top_logprobs=[[TopLogprob(97, "a", -0.5)], [TopLogprob(99, "c", -0.1)]],
        finish_reason="length",
    )
    prompt = PromptInfo(token_ids=[1, 72], token_texts=["<s>", "Hi"], logprobs=[None, -3.0])
    body = tgi.render_result(req, JobResult(choices=[choice], prompt=prompt), special=frozenset({1}))
    exact(body, {
        "generated_text": "Hiab",
        "details": {
            "finish_reason": "length",
            "generated_tokens": 2,
            "seed": None,
            "prefill": [{"id": 1, "text": "<s>", "logprob": None}, {"id": 72, "text": "Hi", "logprob": -3.0}],
            "tokens": [
                {"id": 97, "text": "a", "logprob": -0.5, "special": False},
                {"id": 98, "text": "b", "logprob": -0.25, "special": False},
            ],
            "top_tokens": [
                [{"id": 97, "text": "a", "logprob": -0.5, "special": False}],
                [{"id": 99, "text": "c", "logprob": -0.1, "special": False}],
            ],
        },
    })
    exact(tgi.render_result(_req({}), JobResult(choices=[choice])), {"generated_text": "ab"})


def test_best_of_answers_the_highest_cumulative_logprob_and_lists_the_others():
    req = _req({"best_of": 2, "do_sample": True, "details": True})
    low = Choice(index=0, text="x", token_ids=[120], token_texts=["x"], logprobs=[-3.0], finish_reason="length")
    high = Choice(
        index=1, text="y", token_ids=[121, 2], token_texts=["y", ""], logprobs=[-0.5, -0.5], finish_reason="stop"
    )
    body = wire(tgi.render_result(req, JobResult(choices=[low, high])))
    assert body["generated_text"] == "y"
    d = body["details"]
    assert (d["finish_reason"], d["generated_tokens"], d["tokens"][-1]["special"]) == ("eos_token", 2, True)
    assert list(d) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens", "best_of_sequences"]
    assert d["best_of_sequences"] == [
        {
            "generated_text": "x",
            "finish_reason": "length",
            "generated_tokens": 1,
            "seed": None,
            "prefill": [],
            "tokens": [{"id": 120, "text": "x", "logprob": -3.0, "special": False}],
        }
    ]


def errors(exc: ServiceError) -> tuple[int, object]:
    status, body = tgi.error_body(exc)
    return status, wire(body)


def test_error_bodies_and_statuses():
    assert errors(InvalidRequest("bad")) == (
        422,
        {"error": "Input validation error: bad", "error_type": "validation"},
    )
    overloaded = error_from_code("overloaded", "Model is overloaded", 429)  # any 429 is TGI's overloaded
    assert errors(overloaded) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    assert errors(GenerationFailed("boom")) == (
        424,
        {"error": "Request failed during generation: boom", "error_type": "generation"},
    )
    assert errors(ServiceError("engine crashed")) == (
        500,
        {"error": "engine crashed", "error_type": "incomplete_generation"},
    )
    assert tgi.error_body(QueueUnavailable("no worker"))[0] == 503
    assert (
        tgi.error_frame(InvalidRequest("x"))
        == b'data:{"error":"Input validation error: x","error_type":"validation"}\n\n'
    )


async def _frames(req, events) -> list[bytes]:
    return await frames(TgiStream(req, inputs="Hi"), events)


async def test_stream_frames_one_event_per_token_and_summary_on_the_last():
    req = _req({"details": True})
    events = [
        Keepalive(),
        Tokens(
            seq=1, deltas=[TokenDelta(token_ids=[97, 98], token_texts=["a", "b"], text="ab", logprobs=[-1.0, -2.0])]
        ),
        Done(
            seq=2,
            deltas=[TokenDelta(token_ids=[2], token_texts=["</s>"], text="", logprobs=[-0.5], finish_reason="stop")],
            usage=Usage(prompt_tokens=3, completion_tokens=3),
        ),
    ]
    frames = await _frames(req, events)
    assert frames[0] == KEEPALIVE
    assert frames[1] == (
        b'data:{"index":1,"token":{"id":97,"text":"a","logprob":-1.0,"special":false},'
        b'"generated_text":null,"details":null}\n\n'
    )
    assert frames[3] == (
        b'data:{"index":3,"token":{"id":2,"text":"</s>","logprob":-0.5,"special":true},"generated_text":"ab",'
        b'"details":{"finish_reason":"eos_token","generated_tokens":3,"seed":null,"input_length":3}}\n\n'
    )
    assert len(frames) == 4


async def test_stream_error_event_ends_the_stream():
    frames = await _frames(_req({}), [Error(seq=1, code="generation_failed", message="boom", status=500)])
    assert frames == [b'data:{"error":"Request failed during generation: boom","error_type":"generation"}\n\n']
    frames = await _frames(_req({}), [Tokens(seq=1, deltas=[TokenDelta(token_ids=[97], text="a")])])
    assert (
        frames[-1] == b'data:{"error":"Incomplete generation stream","error_type":"incomplete_generation_stream"}\n\n'
    )


def test_info_is_tgis_info_in_its_key_order():
    info = tgi.Info(model_id="tiny", max_concurrent_requests=8, max_input_tokens=1023, max_total_tokens=1024,
                    version="1.2")
    exact(info, {
        "model_id": "tiny",
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": 8,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_tokens": 1023,
        "max_total_tokens": 1024,
        "validation_workers": 1,
        "max_client_batch_size": 4,
        "router": "llmq",
        "version": "1.2",
        "sha": None,
        "docker_label": None,
    })
