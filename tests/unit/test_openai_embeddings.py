"""OpenAI ``/v1/embeddings`` as a pure translator and renderer (api/dialects/openai_embeddings.py):
the four input forms, their refusals, and the two encodings of the same float32 bytes."""

from __future__ import annotations

import array
import base64
import struct

import msgspec
import pytest

from api.dialects import openai_embeddings as oe
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest, JobResult, Pooled, Pooling, Usage, estimate_tokens


def translated(body: dict) -> GenerationRequest:
    return oe.to_generation_request(msgspec.json.decode(msgspec.json.encode(body), type=oe.EmbeddingRequest))


@pytest.mark.parametrize(("given", "inputs"), [
    ("hello", {"texts": ["hello"]}),
    (["a", "", "a"], {"texts": ["a", "", "a"]}),
    ([1, 2, 3], {"token_ids": [[1, 2, 3]]}),
    ([[1, 2], [3]], {"token_ids": [[1, 2], [3]]}),
])
def test_the_four_input_forms_become_one_pooling_job(given, inputs):
    req = translated({"model": "m", "input": given, "dimensions": 16, "user": "u-1"})
    assert req.pooling == Pooling(task="embed", dimensions=16, **inputs)
    assert (req.model, req.dialect, req.kind, req.output.reported.user) == ("m", "openai_embeddings", "embed", "u-1")


@pytest.mark.parametrize("given", [[], ["a", 1], [True, 2], [-1], [[1], []], [[1], "a"], [1.5], [[2**63]],
                                   ["x"] * (oe.MAX_INPUTS + 1)])
def test_what_is_none_of_them_is_a_400_naming_input(given):
    with pytest.raises(InvalidRequest) as refused:
        translated({"model": "m", "input": given})
    assert refused.value.param == "input"


def test_an_unknown_encoding_is_refused_when_decoded():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"model":"m","input":"x","encoding_format":"int8"}', type=oe.EmbeddingRequest)


ROWS = [[0.1, -2.5, 3.0e-8], [1.0, 0.0, -0.333]]
DATA = array.array("f", [v for row in ROWS for v in row]).tobytes()


def result() -> JobResult:
    return JobResult(pooled=Pooled(data=DATA, width=3), usage=Usage(prompt_tokens=7))


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_both_encodings_carry_the_same_float32_bits(encoding):
    req = translated({"model": "m", "input": ["a", "b"], "encoding_format": encoding})
    body = msgspec.json.decode(msgspec.json.encode(oe.render_result(req, result(), "j1", 5)))
    assert {k: body[k] for k in ("id", "object", "created", "model", "usage")} == {
        "id": "embd-j1", "object": "list", "created": 5, "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    for row, d in zip(ROWS, body["data"], strict=True):
        bits = (base64.b64decode(d["embedding"]) if encoding == "base64"
                else struct.pack("<3f", *d["embedding"]))  # a float's JSON is the float32's exact value
        assert bits == struct.pack("<3f", *row)


def test_a_pooling_job_is_charged_its_inputs_and_nothing_generated():
    texts = translated({"model": "m", "input": ["abcdefgh", "abcd"]})
    ids = translated({"model": "m", "input": [[1, 2, 3], [4]]})
    assert estimate_tokens(texts, 2048) == (8 + 4) // 4 + 2
    assert estimate_tokens(ids, 2048) == 4


def test_a_job_is_a_prompt_or_a_pooling_job_never_both():
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest(prompt="x", pooling=Pooling(task="embed", texts=["x"]))
    with pytest.raises(ValueError, match="one query or one per text"):
        Pooling(task="score", texts=["a", "b", "c"], queries=["q1", "q2"])
